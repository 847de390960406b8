"""A held task is kept alive within bounds: not past its deadline (plus a grace), not while the compute thread
shows no progress (and then heartbeats stop claiming the base); a batch whose completion fails on the loop is
logged and given back, never left held. Pure logic of the worker connection with small fakes (no NATS)."""

from __future__ import annotations

import asyncio
import logging
import time
import types
from collections.abc import Callable
from typing import Any

import pytest

from lorafleet.core.config import BaseModelSpec, FleetConfig, QueueConfig
from lorafleet.core.wire import Heartbeat, Task
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.batcher import Batch, Pulled
from lorafleet.sidecar.connection import NatsSide
from lorafleet.sidecar.settle import Outcome


class Msg:
    """A held JetStream message: counts in_progress calls, records how it was settled."""

    def __init__(self, name: str, deadline_s: float) -> None:
        self.task = Task(id=name, request_id=name, index=0, model="b", base="b", text="x", tokens=1,
                         deadline=time.time() + deadline_s, reply=f"_INBOX.gw.{name}")
        self.data = self.task.to_wire()
        self.subject = "lorafleet.work.b"
        self.headers = None
        self.metadata = types.SimpleNamespace(num_delivered=1, num_pending=0)
        self.progress = 0
        self.settled: list[str] = []
        self.changed = asyncio.Event()

    async def in_progress(self) -> None:
        self.progress += 1
        self.changed.set()

    async def ack(self) -> None:
        self.settled.append("ack")
        self.changed.set()

    async def nak(self, delay: float | None = None) -> None:
        self.settled.append("nak")
        self.changed.set()

    async def term(self) -> None:
        self.settled.append("term")
        self.changed.set()


async def until(msg: Msg, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for `cond` (re-checked whenever `msg` changes)."""
    async def wait() -> None:
        while not cond():
            msg.changed.clear()
            await msg.changed.wait()
    await asyncio.wait_for(wait(), timeout)


class Nc:
    def __init__(self) -> None:
        self.heartbeats: list[Heartbeat] = []

    async def publish(self, subject: str, body: bytes) -> None:
        self.heartbeats.append(Heartbeat.from_wire(body))


def make_side() -> NatsSide:
    fleet = FleetConfig(bases=[BaseModelSpec(name="b", source="/nowhere")], queue=QueueConfig(ack_wait_s=0.15))
    side = NatsSide(fleet, "nats://127.0.0.1:1", "w1", ["b"], lambda base, adapter: fleet.worker.profile)
    assert side._progress_every == pytest.approx(0.05)
    side.nc = Nc()
    return side


def batch_of(side: NatsSide, *msgs: Msg) -> Batch:
    return Batch("b", None, [Pulled(m.task, m) for m in msgs], side.fleet.worker.profile)


async def test_no_in_progress_past_the_deadline() -> None:
    side = make_side()
    expired, live = Msg("expired", -60.0), Msg("live", 60.0)
    side.held.add(expired)
    side.held.add(live)
    loop = asyncio.create_task(side._progress_loop())
    try:
        await until(live, lambda: live.progress >= 10)
    finally:
        loop.cancel()
    assert expired.progress == 0, "a task a minute past its deadline was still kept alive"


async def test_in_progress_stops_once_the_deadline_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafleet.sidecar import keepalive

    monkeypatch.setattr(keepalive, "DEADLINE_GRACE_S", 0.1)
    monkeypatch.setenv("LORAFLEET_CLOCK_SKEW_S", "0")  # one host, one clock: no skew tolerance on top
    side = make_side()
    soon, live = Msg("soon", 0.2), Msg("live", 60.0)
    side.held.add(soon)
    side.held.add(live)
    loop = asyncio.create_task(side._progress_loop())
    try:
        await until(live, lambda: live.progress >= 12)  # ≥ 0.6 s: well past 0.2 s + 0.1 s grace
        last = soon.progress
        await until(live, lambda: live.progress >= 18)
    finally:
        loop.cancel()
    assert 1 <= last == soon.progress  # kept alive while it was worth it, then let go


async def test_a_stuck_compute_thread_stops_keepalives_and_heartbeats_for_its_base() -> None:
    side = make_side()
    side.stuck_after_s = 0.3
    stuck, waiting = Msg("stuck", 60.0), Msg("waiting", 60.0)  # in the compute thread's hands; not handed off
    side.held.add(stuck)
    side.held.add(waiting)
    batch = batch_of(side, stuck)
    side._handoff(batch)
    await side._publish_heartbeat(0.0)
    assert side.nc.heartbeats[-1].bases == ["b"]  # fresh: it serves
    loop = asyncio.create_task(side._progress_loop())
    try:
        await until(waiting, lambda: waiting.progress >= 16)  # ≥ 0.8 s, well past 0.3 s without progress
        frozen = stuck.progress
        await until(waiting, lambda: waiting.progress >= 24)
        assert stuck.progress == frozen, "a task in a stuck compute thread's hands was still kept alive"
        await side._publish_heartbeat(0.0)
        hb = side.nc.heartbeats[-1]
        assert hb.bases == [] and hb.in_flight == 2, "a stuck worker still claims its base"
        # progress again: the batch comes back, its task is settled and the base is claimed again
        side._slots = asyncio.Semaphore(0)
        settler = types.SimpleNamespace(calls=0, tasks_done=0)

        async def complete(b: Batch, outcomes: Any, started: float) -> None:
            settler.calls += 1
            for p in b.items:
                side.held.discard(p.msg)
        settler.complete = complete
        side._settler = settler  # type: ignore[assignment]
        await side._complete(batch, [Outcome(Situation.OK, vector=b"\0" * 4)], time.time(), None)
        await side._publish_heartbeat(0.0)
        assert settler.calls == 1 and side.nc.heartbeats[-1].bases == ["b"]
    finally:
        loop.cancel()


async def test_a_failing_completion_is_logged_and_its_tasks_given_back(caplog: pytest.LogCaptureFixture) -> None:
    side = make_side()
    side.loop = asyncio.get_running_loop()
    side._slots = asyncio.Semaphore(0)
    a, b = Msg("a", 60.0), Msg("b", 60.0)
    side.held.add(a)
    side.held.add(b)
    batch = batch_of(side, a, b)
    side._handoff(batch)
    assert side.ready.get_nowait() is batch

    async def complete(batch: Batch, outcomes: Any, started: float) -> None:
        raise RuntimeError("boom in settle")
    side._settler = types.SimpleNamespace(complete=complete, tasks_done=0)  # type: ignore[assignment]
    outcomes = [Outcome(Situation.OK, vector=b"\0" * 4)] * 2
    with caplog.at_level(logging.ERROR, logger="lorafleet.sidecar.connection"):
        await asyncio.to_thread(side.complete, batch, outcomes, time.time())  # from another thread, as the worker
        await until(a, lambda: bool(a.settled) and bool(b.settled), timeout=5.0)
    assert a.settled == ["nak"] and b.settled == ["nak"] and len(side.held) == 0
    assert "boom in settle" in caplog.text
