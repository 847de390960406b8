"""The main-thread side of the worker with a fake runtime: deadlines, adapter failures, poison inputs."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from lorafleet.config import ConfigError, FleetConfig, ServingProfile
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.adapters import AdapterCache
from lorafleet.sidecar.batcher import Batch, Pulled
from lorafleet.sidecar.compute import Computer
from lorafleet.sidecar.runtime import Runtime
from lorafleet.sidecar.worker import FleetLookup, adapter_policy, select_bases
from lorafleet.wire import Task


class FakeRuntime(Runtime):
    """Encodes text length (and the adapter's name length) into the vector; fails on any batch containing
    'POISON'. Mixed batches go through the contract's default `encode_mixed` (one `encode` per adapter)."""

    dim = 3

    def __init__(self) -> None:
        self.calls: list[tuple[int, str | None]] = []
        self.loaded: list[str] = []

    def encode(self, texts: list[str], adapter_id: str | None) -> np.ndarray:
        self.calls.append((len(texts), adapter_id))
        if any("POISON" in t for t in texts):
            raise RuntimeError("poisoned")
        return np.array([[len(t), len(adapter_id or ""), 1] for t in texts], dtype=np.float32)

    def load_adapter(self, adapter_id: str, path: str) -> None:
        if "flaky" in path:
            raise OSError("disk hiccup")
        self.loaded.append(adapter_id)

    def unload_adapter(self, adapter_id: str) -> None:
        self.loaded.remove(adapter_id)

    def loaded_adapters(self) -> list[str]:
        return list(self.loaded)

    def close(self) -> None:
        pass


def item(i: int, text: str, adapter: str | None, uri: str | None, deadline_s: float = 30) -> Pulled:
    return Pulled(Task(id=f"t{i}", request_id="r", index=i, model="m", base="m", text=text, tokens=3,
                       deadline=time.time() + deadline_s, reply="_INBOX.g.r", adapter=adapter, adapter_uri=uri),
                  msg=None)


def batch(texts: list[str], adapter: str | None = None, uri: str | None = None, deadline_s: float = 30) -> Batch:
    items = [item(i, t, adapter, uri, deadline_s) for i, t in enumerate(texts)]
    return Batch("m", adapter, items, ServingProfile())


def mixed(rows: list[tuple[str, str | None]]) -> Batch:
    """A mixed batch: (text, adapter) per row; an adapter's URI is its name (resolved under tmp_path)."""
    return Batch("m", None, [item(i, t, a, a) for i, (t, a) in enumerate(rows)], ServingProfile(), mixed=True)


def computer(tmp_path: Path, fleet: FleetConfig | None = None) -> tuple[Computer, FakeRuntime]:
    rt = FakeRuntime()
    cache = AdapterCache(rt, 2, resolve=lambda uri: tmp_path / uri)
    return Computer({"m": rt}, {"m": cache}, FleetLookup(fleet or FleetConfig())), rt


def test_ok_vectors_are_little_endian_float32(tmp_path: Path) -> None:
    comp, _ = computer(tmp_path)
    outcomes, started = comp.run(batch(["ab", "abcd"]))
    assert started <= time.time()
    assert [o.situation for o in outcomes] == [Situation.OK, Situation.OK]
    assert np.frombuffer(outcomes[1].vector or b"", dtype="<f4").tolist() == [4.0, 0.0, 1.0]
    assert comp.last_encode is not None and comp.last_encode[0] == 2  # timed, for max_batch_ms


def test_poison_input_is_isolated_by_bisection(tmp_path: Path) -> None:
    comp, _ = computer(tmp_path)
    outcomes, _ = comp.run(batch(["a", "b", "POISON", "c", "d"]))
    assert [o.situation for o in outcomes] == [Situation.OK] * 2 + [Situation.RUNTIME_FAILED] + [Situation.OK] * 2
    assert "poisoned" in outcomes[2].message
    assert comp.last_encode is None  # a bisected batch's time is not its size's cost


def test_expired_tasks_are_not_computed(tmp_path: Path) -> None:
    comp, rt = computer(tmp_path)
    outcomes, _ = comp.run(batch(["a", "b"], deadline_s=-1))
    assert [o.situation for o in outcomes] == [Situation.DEADLINE] * 2 and rt.calls == []


def test_adapter_failures_are_classified(tmp_path: Path) -> None:
    comp, rt = computer(tmp_path)
    outcomes, _ = comp.run(batch(["a"], adapter="x", uri=None))
    assert outcomes[0].situation is Situation.ADAPTER_UNAVAILABLE  # no URI anywhere: permanent
    outcomes, _ = comp.run(batch(["a"], adapter="f", uri="flaky"))
    assert outcomes[0].situation is Situation.ADAPTER_FAILED and "disk hiccup" in outcomes[0].message
    outcomes, _ = comp.run(batch(["a"], adapter="ok", uri="ok"))
    assert outcomes[0].situation is Situation.OK and rt.calls[-1] == (1, "ok") and comp.adapters_changed
    assert comp.snapshot() == {"m": ["ok"]}


def test_fleet_lookup_uses_served_models(tmp_path: Path) -> None:
    fleet = FleetConfig.model_validate({
        "bases": [{"name": "m"}],
        "models": [{"name": "legal", "base": "m", "adapter": "/adapters/legal", "adapter_id": "legal@3",
                    "profile": {"max_batch_items": 4}}],
    })
    lookup = FleetLookup(fleet)
    assert lookup.uri_for("legal@3", None) == "/adapters/legal"
    # The worker's own fleet file (and fleet state) wins over what a task claims; unknown ids use the task's URI,
    # which the adapter policy then checks like any other.
    assert lookup.uri_for("legal@3", "/elsewhere") == "/adapters/legal"
    assert lookup.uri_for("other@1", "/elsewhere") == "/elsewhere"
    policy = adapter_policy(fleet)
    assert Path("/adapters/legal") in policy.roots and policy.schemes == {"models"}
    assert lookup.profile_for("m", "legal@3").max_batch_items == 4
    assert lookup.profile_for("m", None) == fleet.worker.profile
    assert select_bases(fleet, None) == ["m"]
    with pytest.raises(ConfigError, match="not among"):
        select_bases(fleet, ["nope"])


def vec(o: object) -> list[float]:
    return np.frombuffer(o.vector or b"", dtype="<f4").tolist()  # type: ignore[attr-defined]


def test_mixed_batch_rows_get_their_own_adapter(tmp_path: Path) -> None:
    comp, rt = computer(tmp_path)
    rows = [("aa", "xy"), ("b", None), ("ccc", "flaky"), ("d", "xyz"), ("eeee", "xy")]
    outcomes, _ = comp.run(mixed(rows))
    # The adapter that fails to load fails only its own task; the others (and the bare row) are computed.
    assert [o.situation for o in outcomes] == [Situation.OK, Situation.OK, Situation.ADAPTER_FAILED, Situation.OK,
                                               Situation.OK]
    assert [vec(outcomes[i])[:2] for i in (0, 1, 3, 4)] == [[2.0, 2.0], [1.0, 0.0], [1.0, 3.0], [4.0, 2.0]]
    assert sorted(rt.loaded) == ["xy", "xyz"] and comp.adapters_changed
    assert comp.last_encode is None  # a partly failed batch's time is not its size's cost


def test_mixed_batch_wider_than_the_cache_runs_in_passes(tmp_path: Path) -> None:
    comp, rt = computer(tmp_path)  # two hot slots
    rows = [(f"t{i}", name) for i, name in enumerate(["p", "qq", "rrr", "p", "qq", "rrr"])]
    outcomes, _ = comp.run(mixed(rows))
    assert [o.situation for o in outcomes] == [Situation.OK] * 6
    assert [vec(o)[1] for o in outcomes] == [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]
    assert len(rt.loaded) <= 2  # the bound held although the batch named three adapters
