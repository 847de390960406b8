"""Pinned versions and retention on promote (issue 25), end to end: a real local cluster (nats-server, a worker
process on the packaged MiniLM, the gateway process), a real MLflow store, `lorafleet promote`'s code path.

A client pinned to NAME@1 gets v1's vectors (equal to encoding with v1's adapter directly) before and after v2
is promoted, and after a gateway restart, until v1's retention window ends; then 410 naming the current version.
Every response names the version that computed it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from lorafleet.core import settings
from lorafleet.core.config import BaseModelSpec, FleetConfig, WorkerConfig
from lorafleet.core.fleet_state import Retention
from lorafleet.ops.cluster import LocalCluster
from lorafleet.registry import store
from lorafleet.registry.promote import Preload, promote
from lorafleet.testing import wait_until

pytestmark = pytest.mark.integration

BASE, NAME = "all-MiniLM-L6-v2", "legal"
TEXTS = ["Der Verkäufer einer Sache ist verpflichtet, dem Käufer die Sache zu übergeben.",
         "Der Mieter hat die Miete zu entrichten."]


def _embed(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": TEXTS, "encoding_format": "float"},
                      timeout=60)


def _vectors(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.asarray([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def _models(url: str) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def _error(r: httpx.Response) -> tuple[int, str, str]:
    err = r.json()["error"]
    return r.status_code, err["code"], err["message"]


def test_pinned_version_survives_promote_until_retention_ends(tmp_path: Path, minilm_path: Path) -> None:
    from lorafleet.cli import app
    from lorafleet.testing import make_random_adapter
    from lorafleet.train.kinds.retrieval.trainer import load_adapter_model

    adapters = {v: make_random_adapter(minilm_path, tmp_path / f"adapter-v{v}", seed=70 + v, scale=2.0)
                for v in (1, 2, 3)}
    for v, path in adapters.items():
        ref = store.register_bundle(NAME, path, base_source=str(minilm_path), base_name=BASE,
                                    metrics={"test_ndcg@10": 0.4 + v / 100, "base_test_ndcg@10": 0.3})
        assert ref.version == str(v)
    expected = {v: np.asarray(load_adapter_model(str(minilm_path), p, "cpu", 128).encode(TEXTS))
                for v, p in adapters.items()}
    assert not np.allclose(expected[1], expected[2], atol=1e-3), "the versions must answer differently"
    fleet = FleetConfig(bases=[BaseModelSpec(name=BASE, source=str(minilm_path))],
                        worker=WorkerConfig(heartbeat_s=0.5))
    quiet = Preload(timeout_s=120.0, progress=lambda _: None)
    with LocalCluster(fleet, workers=1, port=0, home=settings.home()) as c:
        url = c.gateway_url
        promote(NAME, "1", nats_url=c.nats_url, fleet_file=c.fleet_file, preload=quiet)
        wait_until(lambda: _embed(url, NAME).status_code == 200, 60, "the gateway routes legal")
        r = _embed(url, f"{NAME}@1")
        assert r.json()["model"] == f"{NAME}@1"
        np.testing.assert_allclose(_vectors(r), expected[1], atol=1e-4)
        assert _embed(url, NAME).json()["model"] == f"{NAME}@1"  # the alias names the version that answered
        assert _embed(url, BASE).json()["model"] == BASE  # a base keeps its plain name

        # v2: v1 stays served as legal@1 (no time limit for now), the alias moves.
        out = promote(NAME, "2", nats_url=c.nats_url, fleet_file=c.fleet_file, preload=quiet,
                      retention=Retention(None, 2))
        assert [k.version for k in out.entry.retained] == ["1"]
        wait_until(lambda: _embed(url, NAME).json().get("model") == f"{NAME}@2", 30, "the alias serves v2")
        np.testing.assert_allclose(_vectors(_embed(url, NAME)), expected[2], atol=1e-4)
        r = _embed(url, f"{NAME}@1")
        assert r.json()["model"] == f"{NAME}@1"
        np.testing.assert_allclose(_vectors(r), expected[1], atol=1e-4)
        models = _models(url)
        assert models[NAME]["version"] == "2"
        assert (models[f"{NAME}@2"]["version"], models[f"{NAME}@2"]["pinned_to"]) == ("2", NAME)
        assert models[f"{NAME}@1"]["version"] == "1" and models[f"{NAME}@1"]["retires"] is None
        assert "version" not in models[BASE]

        # Malformed and unknown pinned names.
        for bad in (f"{NAME}@x", f"{NAME}@"):
            status, code, message = _error(_embed(url, bad))
            assert (status, code) == (400, "invalid_model_name") and "NAME@N" in message, message
        status, code, message = _error(_embed(url, f"{NAME}@9"))
        assert (status, code) == (404, "model_not_found") and f"{NAME}@2, {NAME}@1" in message, message

        # The CLI takes the pinned name and reports the version that answered.
        res = CliRunner().invoke(app, ["embed", "-m", f"{NAME}@1", "--url", url, "--json", TEXTS[0]])
        assert res.exit_code == 0, res.output
        assert f'"model": "{NAME}@1"' in res.output

        # A gateway restart keeps the retained version (it lives in the fleet state).
        gw = c.procs["gateway"]
        gw.terminate()
        gw.wait(30)
        c.respawn("gateway")
        c.wait_ready(timeout=60, workers=1)
        wait_until(lambda: _embed(url, f"{NAME}@1").status_code == 200, 60, "legal@1 after the gateway restart")
        np.testing.assert_allclose(_vectors(_embed(url, f"{NAME}@1")), expected[1], atol=1e-4)

        # v3 with a short window: v2 is retained for 3 s, then retired; v1 (no time limit) stays.
        started = time.time()
        promote(NAME, "3", nats_url=c.nats_url, fleet_file=c.fleet_file, preload=quiet,
                retention=Retention(3.0, 2))
        wait_until(lambda: _embed(url, NAME).json().get("model") == f"{NAME}@3", 30, "the alias serves v3")
        r = _embed(url, f"{NAME}@2")
        if time.time() - started < 3.0:  # still in its window (a slow machine may be past it already)
            assert r.status_code == 200 and r.json()["model"] == f"{NAME}@2"
            np.testing.assert_allclose(_vectors(r), expected[2], atol=1e-4)
        gone = wait_until(lambda: (x := _embed(url, f"{NAME}@2")).status_code == 410 and x, 30, "legal@2 retired")
        status, code, message = _error(gone)
        assert code == "version_retired" and f"the current version is {NAME}@3" in message, message
        np.testing.assert_allclose(_vectors(_embed(url, f"{NAME}@1")), expected[1], atol=1e-4)
        assert f"{NAME}@2" not in _models(url)
