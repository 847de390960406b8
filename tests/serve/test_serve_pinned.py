"""Pinned served names NAME@N (issue 25), the pure parts: parsing, and the resolver's routes and refusals."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from lorafleet.core.config import ServedModel
from lorafleet.core.fleet_state import FleetEntry, Retention, merge_models, with_retention
from lorafleet.core.refs import PinnedNameError, parse_pinned
from lorafleet.serve.errors import ApiError
from lorafleet.serve.resolver import Resolver
from lorafleet.testing import wait_until

BASE = "tiny"


@pytest.mark.parametrize("text, parsed", [("legal", None), ("legal@4", ("legal", "4")),
                                          ("a.b-c_d@12", ("a.b-c_d", "12")), ("legal@04", ("legal", "4"))])
def test_parse_pinned(text: str, parsed: tuple[str, str] | None) -> None:
    assert parse_pinned(text) == parsed


@pytest.mark.parametrize("text", ["legal@", "legal@x", "legal@v4", "@4", "legal@champion", "a@b@4", "le gal@4"])
def test_malformed_pinned_names_name_the_syntax(text: str) -> None:
    with pytest.raises(PinnedNameError, match=r"NAME@N"):
        parse_pinned(text)


def _entry(version: str) -> FleetEntry:
    return FleetEntry(name="legal", base=BASE, adapter_id=f"legal@v{version}", adapter_uri=f"models:/legal/{version}",
                      version=version, registered_model="legal", action="promote")


def _resolver(versions: list[str], retention: Retention, times: list[float],
              static: list[ServedModel] | None = None) -> Resolver:
    live = None
    for v, t in zip(versions, times, strict=True):
        live = with_retention(live, _entry(v), retention, t)
    assert live is not None
    r = Resolver([BASE])
    r.set_models(merge_models(static or [], [live], [BASE]), None, [live])
    return r


def test_routes_name_the_version() -> None:
    r = _resolver(["1", "2"], Retention(100.0, 2), [0.0, 10.0])
    alias = r.resolve("legal")
    assert alias is not None and (alias.model, alias.adapter) == ("legal@2", "legal@v2")
    assert r.resolve(BASE) is not None and r.resolve(BASE).model == BASE  # type: ignore[union-attr]
    assert r.resolve_pinned("legal", now=20.0) is None  # no @: not a pinned name
    v2 = r.resolve_pinned("legal@2", now=20.0)
    assert v2 is not None and v2 == alias
    v1 = r.resolve_pinned("legal@1", now=20.0)
    assert v1 is not None and (v1.name, v1.model, v1.adapter, v1.adapter_uri) == \
        ("legal", "legal@1", "legal@v1", "models:/legal/1")


def _refusal(r: Resolver, name: str, now: float) -> ApiError:
    with pytest.raises(ApiError) as info:
        r.resolve_pinned(name, now=now)
    return info.value


def test_refusals() -> None:
    r = _resolver(["1", "2", "3"], Retention(100.0, 1), [0.0, 10.0, 20.0])  # v2 retained until 120, v1 retired
    e = _refusal(r, "legal@x", 30.0)
    assert (e.status, e.code) == (400, "invalid_model_name") and "NAME@N" in e.message
    e = _refusal(r, "legal@", 30.0)
    assert e.status == 400 and "NAME@N" in e.message
    e = _refusal(r, "legal@7", 30.0)
    assert (e.status, e.code) == (404, "model_not_found") and "legal@3, legal@2" in e.message
    e = _refusal(r, "legal@1", 30.0)  # retired by count at the last promote
    assert (e.status, e.code) == (410, "version_retired") and "current version is legal@3" in e.message
    assert r.resolve_pinned("legal@2", now=119.0) is not None
    e = _refusal(r, "legal@2", 120.0)  # its window ended; nobody wrote the fleet state
    assert (e.status, e.code) == (410, "version_retired") and "legal@3" in e.message and "retired at" in e.message
    e = _refusal(r, "other@1", 30.0)
    assert (e.status, e.code) == (404, "model_not_found")
    e = _refusal(r, f"{BASE}@1", 30.0)  # a base has no versions
    assert e.status == 404


def test_fleet_file_model_with_the_same_name_is_not_versioned() -> None:
    static = [ServedModel(name="solo", base=BASE, adapter="/adapters/solo")]
    r = _resolver(["1"], Retention(), [0.0], static)
    solo = r.resolve("solo")
    assert solo is not None and solo.version is None and solo.model == "solo"
    assert sorted(r.pinned()) == ["legal"]


@pytest.mark.integration
def test_generative_responses_name_the_version(tmp_path: Path) -> None:
    """A real cluster (nats-server, a transformers worker on the tiny Llama, the gateway): chat, completion and
    every streamed chunk name the version that generated them; a pinned retained version generates with its own
    adapter (equal to direct transformers)."""
    from generate_kit import GREEDY, QUESTIONS, build_tiny, chat, fleet, put_fleet_entry, transformers_reference

    from lorafleet.ops.cluster import LocalCluster

    tiny = build_tiny(tmp_path / "tiny-llama")

    def entry(version: str, lora: str) -> FleetEntry:
        return FleetEntry(name="spec", base="tiny-llama", adapter_id=f"spec@v{version}", adapter_uri=str(tiny[lora]),
                          version=version, registered_model="spec", kind="causal-lm")

    live = with_retention(entry("1", "a"), entry("2", "b"), Retention(None, 2), 0.0)
    q = QUESTIONS[0]
    expected = {v: transformers_reference(tiny["base"], tiny[lora], [q], GREEDY["max_tokens"], True)[0]
                for v, lora in (("1", "a"), ("2", "b"))}
    with LocalCluster(fleet(tiny, "transformers"), workers=1, port=0, home=tmp_path / "home") as c:
        asyncio.run(put_fleet_entry(c, live))
        url = c.gateway_url
        wait_until(lambda: "spec@1" in {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}, 20,
                   "the pinned versions in /v1/models")
        for asked, version in (("spec", "2"), ("spec@2", "2"), ("spec@1", "1")):
            r = httpx.post(f"{url}/v1/completions", json={"model": asked, "prompt": q, **GREEDY}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == f"spec@{version}" and r.json()["choices"][0]["text"] == expected[version]
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "spec", "messages": chat(q), **GREEDY}, timeout=120)
        assert r.status_code == 200 and r.json()["model"] == "spec@2", r.text
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                          json={"model": "spec@1", "messages": chat(q), "stream": True, **GREEDY}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert len(events) > 2 and {e["model"] for e in events} == {"spec@1"}, events
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-a", "prompt": q, **GREEDY}, timeout=120)
        assert r.json()["model"] == "tiny-a"  # a fleet-file model has no version: its plain name
