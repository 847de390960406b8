"""The main-thread side of the worker with a fake runtime: deadlines, adapter failures, poison inputs."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from sidecar_testkit import until

from lorafleet.core.config import ConfigError, FleetConfig, ServingProfile
from lorafleet.core.wire import Task
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.adapters import AdapterCache
from lorafleet.sidecar.batcher import Batch, Pulled
from lorafleet.sidecar.compute import Computer
from lorafleet.sidecar.runtime import Runtime
from lorafleet.sidecar.scheduler import PullScheduler
from lorafleet.sidecar.settle import HeldTable, Outcome
from lorafleet.sidecar.worker import FleetLookup, adapter_policy, select_bases


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


class Download:
    """A `models:` resolve that blocks until `release` (a registry download in flight); local paths resolve at once."""

    def __init__(self, tmp_path: Path, fail: BaseException | None = None) -> None:
        self.tmp_path = tmp_path
        self.fail = fail
        self.started = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []

    def __call__(self, uri: str) -> Path:
        if uri.startswith("models:"):
            self.threads.append(threading.current_thread().name)
            self.started.set()
            assert self.release.wait(30), "the download was never released"
            if self.fail is not None:
                raise self.fail
        return self.tmp_path / uri.rsplit("/", 1)[-1]


class Side:
    """The NATS side as the Computer sees it: rows that waited for a fetch come back through `resume`."""

    def __init__(self) -> None:
        self.resumed: queue.Queue[Batch] = queue.Queue()

    def resume(self, batch: Batch) -> None:
        self.resumed.put(batch)


def run_within(comp: Computer, b: Batch, timeout: float = 5.0) -> list[Outcome]:
    """comp.run(b) on a thread of its own (the worker's main thread): it must return within `timeout`."""
    out: list[list[Outcome]] = []
    t = threading.Thread(target=lambda: out.append(comp.run(b)[0]), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"Computer.run blocked for {timeout:.0f}s on an adapter download"
    assert len(out[0]) == len(b.items)  # one outcome per row left in the batch
    return out[0]


def two_bases(tmp_path: Path, resolve: Download) -> tuple[Computer, dict[str, FakeRuntime], Side]:
    rts = {"m": FakeRuntime(), "n": FakeRuntime()}
    caches = {b: AdapterCache(rt, 2, resolve=resolve) for b, rt in rts.items()}
    side = Side()
    return Computer(rts, caches, FleetLookup(FleetConfig()), side), rts, side


def ids(b: Batch) -> list[str]:
    return [p.task.id for p in b.items]


def test_a_registry_download_holds_up_no_other_batch(tmp_path: Path) -> None:
    # Issue 23 item 9: an on-demand models: download ran on the compute thread and blocked every base.
    download = Download(tmp_path)
    comp, rts, side = two_bases(tmp_path, download)
    b = batch(["a", "bb"], adapter="reg", uri="models:/reg/1")
    try:
        assert run_within(comp, b) == [] and b.items == []  # nothing to settle now, nothing failed
        assert download.started.wait(5) and comp.waiting is not None and ids(comp.waiting) == ["t0", "t1"]
        # While the download runs: the bare base and another base compute.
        assert [o.situation for o in run_within(comp, batch(["ccc"]))] == [Situation.OK]
        other = Batch("n", "local", [item(0, "dddd", "local", "local")], ServingProfile())
        assert [o.situation for o in run_within(comp, other)] == [Situation.OK]
        assert rts["m"].calls == [(1, None)] and rts["n"].calls == [(1, "local")] and side.resumed.empty()
    finally:
        download.release.set()
    resumed = side.resumed.get(timeout=5)  # once the download ends, its tasks come back to be computed
    assert ids(resumed) == ["t0", "t1"] and "MainThread" not in download.threads
    assert [o.situation for o in run_within(comp, resumed)] == [Situation.OK, Situation.OK] and comp.waiting is None
    assert rts["m"].calls[-1] == (2, "reg")


def test_a_mixed_batch_computes_its_ready_rows_while_one_adapter_downloads(tmp_path: Path) -> None:
    download = Download(tmp_path)
    comp, _, side = two_bases(tmp_path, download)
    rows = [item(0, "a", "loc", "loc"), item(1, "bb", "reg", "models:/reg/1"), item(2, "ccc", None, None)]
    b = Batch("m", None, rows, ServingProfile(), mixed=True)
    try:
        assert [o.situation for o in run_within(comp, b)] == [Situation.OK, Situation.OK] and ids(b) == ["t0", "t2"]
        assert comp.waiting is not None and ids(comp.waiting) == ["t1"] and comp.waiting.mixed
        assert comp.last_encode is None  # a part of the batch: its time is not its size's cost
    finally:
        download.release.set()
    outcomes = run_within(comp, side.resumed.get(timeout=5))
    assert [o.situation for o in outcomes] == [Situation.OK] and vec(outcomes[0])[:2] == [2.0, 3.0]


def test_a_failed_download_fails_its_tasks_for_a_retry(tmp_path: Path) -> None:
    download = Download(tmp_path, fail=OSError("registry unreachable"))
    comp, _, side = two_bases(tmp_path, download)
    b = batch(["a"], adapter="reg", uri="models:/reg/1")
    try:
        assert run_within(comp, b) == [] and download.started.wait(5)
    finally:
        download.release.set()
    resumed = side.resumed.get(timeout=5)
    outcomes = run_within(comp, resumed)
    assert [o.situation for o in outcomes] == [Situation.ADAPTER_FAILED]  # transient: nak'ed, retried later
    assert "registry unreachable" in outcomes[0].message
    # The next try fetches afresh (a failure is not remembered).
    download.fail, download.started, download.release = None, threading.Event(), threading.Event()
    try:
        assert run_within(comp, batch(["a"], adapter="reg", uri="models:/reg/1")) == [] and download.started.wait(5)
    finally:
        download.release.set()
    assert [o.situation for o in run_within(comp, side.resumed.get(timeout=5))] == [Situation.OK]


async def test_resumed_rows_wait_for_a_slot_and_skip_what_was_given_back() -> None:
    held, handed = HeldTable(), []
    slots = asyncio.Semaphore(1)
    await slots.acquire()  # the one slot computes another batch
    sched = PullScheduler(FleetConfig.model_validate({"bases": [{"name": "m"}]}), {"m": None}, held, None,  # type: ignore[arg-type]
                          handed.append, lambda b, a: ServingProfile(), slots, lambda: False)
    b = batch(["a", "bb", "ccc"])
    for p in b.items:
        p.msg = object()
        held.add(p.msg)
    sched.resume(b)
    held.discard(b.items[1].msg)  # a drain that timed out gave this one back meanwhile
    for _ in range(5):
        await asyncio.sleep(0)
    assert handed == []  # no slot free: the waiting rows hold none, and take none from a running batch
    slots.release()
    await until(lambda: bool(handed), 5.0, "the resumed rows were handed to the main thread")
    (again,) = handed
    assert ids(again) == ["t0", "t2"] and again.seq > 0 and slots.locked()
