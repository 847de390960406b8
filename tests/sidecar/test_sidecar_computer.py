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
from lorafleet.sidecar.worker import Computer, FleetLookup, adapter_policy, select_bases
from lorafleet.wire import Task


class FakeRuntime:
    """Encodes text length into the vector; fails on any batch containing 'POISON'."""

    dim = 3

    def __init__(self) -> None:
        self.calls: list[tuple[int, str | None]] = []
        self.loaded: list[str] = []

    def encode(self, texts: list[str], adapter_id: str | None) -> np.ndarray:
        self.calls.append((len(texts), adapter_id))
        if any("POISON" in t for t in texts):
            raise RuntimeError("poisoned")
        return np.array([[len(t), 0, 1] for t in texts], dtype=np.float32)

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


def batch(texts: list[str], adapter: str | None = None, uri: str | None = None, deadline_s: float = 30) -> Batch:
    items = [Pulled(Task(id=f"t{i}", request_id="r", index=i, model="m", base="m", text=t, tokens=3,
                         deadline=time.time() + deadline_s, reply="_INBOX.g.r", adapter=adapter, adapter_uri=uri),
                    msg=None) for i, t in enumerate(texts)]
    return Batch("m", adapter, items, ServingProfile())


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
