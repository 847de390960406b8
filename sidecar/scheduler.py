"""Scheduling: when this worker pulls, from which base, how many tasks, and how they become batches.

One loop over every base's consumer: a free slot goes to the base whose waiting task is oldest.
A loop per base would let a base with an empty queue sit on a slot while another base has a
backlog. Each base keeps one open fetch(1) (its waiter) across cycles; a slot fills one batch,
from the base whose head task is oldest, so a worker never holds full batches of several bases at
once (tasks that an idle peer could serve). With `SORT_WINDOW_BATCHES` above 1 (LORAFLEET_SORT_WINDOW; off by
default), a pull takes up to that many batches' worth of a backlog (never waiting for more) and sorts the
window by length before cutting batches; a worker with a batch-time budget (`max_batch_ms`) keeps to one.
A head that lands while the worker is busy waits, held
and kept alive, for the next free slot. A slot is one batch queued or computing here; it frees
when the main thread posts the batch's outcome back. Rows whose adapter is still being downloaded
leave their batch and hold no slot while they wait (compute.py); they take one again when the
download ends (`resume`).

Before a task is computed, `admit` (intake.py) drops what nobody waits for: malformed and expired
tasks, and tasks whose gateway is gone. These are the bases of in-process (batch) runtimes; an
engine runtime's base has a lane of its own (engine_lane.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lorafleet.core.config import FleetConfig
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.batcher import Batch, ProfileFor, Pulled, form_batches
from lorafleet.sidecar.intake import Intake
from lorafleet.sidecar.owners import OwnerTracker
from lorafleet.sidecar.pull import IDLE_POLL_S, ArrivalRate, BatchTime, fill, wait_first
from lorafleet.sidecar.service_rate import ServiceRate
from lorafleet.sidecar.settle import HeldTable, Settlement, Settler

log = logging.getLogger(__name__)

# How many batches' worth of backlog one pull may sort together before cutting batches (issue 27: arrivals in
# queue order pad each other to their longest). Off (1) by default: on a 2-vCPU machine at load 15–25, a window of
# 2 served within the round-to-round spread of one batch per pull at c=32 (docs/benchmarks.md §1b), so it is not
# worth committing twice the tasks to one worker until a quiet machine shows a gain. LORAFLEET_SORT_WINDOW=2
# turns it on (bench/serve.py's `auto:old` / `auto:nocuts` variants compare).
SORT_WINDOW_BATCHES = max(1, int(os.environ.get("LORAFLEET_SORT_WINDOW", "1")))


def pull_window(cap: int, max_batch_ms: float | None) -> int:
    """The most tasks one pull takes: `cap` (one batch) under a batch-time budget, else SORT_WINDOW_BATCHES × cap."""
    return cap if max_batch_ms is not None else cap * SORT_WINDOW_BATCHES  # read per call: tests may set it


def stream_seq(msg: Any) -> int:
    try:
        return int(msg.metadata.sequence.stream)
    except Exception:
        return 0


def pull_cap(fleet: FleetConfig, base: str) -> int:
    """The most tasks one pull may take for `base`: the largest batch any of its profiles allows."""
    caps = [fleet.worker.profile.max_batch_items]
    caps += [m.profile.max_batch_items for m in fleet.models if m.base == base and m.profile]
    return max(caps)


class PullScheduler:
    """Runs the pull loop on the worker's event loop; hands finished batches to `handoff` (the main thread)."""

    def __init__(self, fleet: FleetConfig, psubs: dict[str, Any], held: HeldTable, settler: Settler,
                 handoff: Callable[[Batch], None], profile_for: ProfileFor, slots: asyncio.Semaphore,
                 stopping: Callable[[], bool], *, owners: OwnerTracker | None = None,
                 on_pull_error: Callable[[str, BaseException], None] | None = None,
                 mixed_bases: frozenset[str] = frozenset(), max_batch_adapters: int | None = None) -> None:
        self.fleet = fleet
        self.bases = list(psubs)
        self.psubs = psubs
        self.held = held
        self.settler = settler
        self.handoff = handoff
        self.profile_for = profile_for
        # Bases whose embed tasks share batches across adapters (the runtime can, the profile wants it).
        self.mixed_bases = mixed_bases
        self.max_batch_adapters = (fleet.worker.profile.max_batch_adapters if max_batch_adapters is None
                                   else max_batch_adapters)
        self.slots = slots
        self.stopping = stopping
        self.phase = ""  # "slot" while waiting for a free slot (holding nothing), then "fetch", "hold"
        self.batch_times = {b: BatchTime() for b in self.bases}  # measured compute time, for max_batch_ms
        self.service_rates = {b: ServiceRate() for b in self.bases}  # tasks per busy second, for heartbeats
        self.owners = owners
        self.intake = Intake(held, settler, owners)
        self.on_pull_error = on_pull_error or (lambda base, exc: log.warning("pull on %s failed: %s", base, exc))
        self._arrivals = ArrivalRate()
        self._waiters: dict[str, asyncio.Task[Any]] = {}  # base → its open fetch(1), kept across cycles
        self._heads: dict[str, Any] = {}  # base → a message its waiter brought that no batch has taken yet
        self._seq = 0
        self._resuming: set[asyncio.Task[None]] = set()  # rows back from an adapter fetch, waiting for a slot

    async def run(self) -> None:
        caps = {base: pull_cap(self.fleet, base) for base in self.bases}
        profile = self.fleet.worker.profile
        while not self.stopping():
            self.phase = "slot"
            await self.slots.acquire()
            self.phase = "fetch"
            if self.stopping():
                self.slots.release()
                break
            head = await self._next_head()
            if head is None:
                self.slots.release()
                continue
            base, first = head
            now = time.monotonic()
            wait_ms = profile.max_wait_ms if self._arrivals.worth_waiting(profile.max_wait_ms, now) else 0.0
            cap = caps[base]
            if profile.max_batch_ms is not None:
                cap = self.batch_times[base].max_items(profile.max_batch_ms / 1000.0, cap)
            window = pull_window(cap, profile.max_batch_ms)
            msgs = [first]  # fill extends it in place: what a failed fetch left behind is batched all the same
            try:
                await fill(self.psubs[base], msgs, cap, wait_ms)
                if cap <= len(msgs) < window:  # a full batch and maybe a backlog: take it, without waiting for more
                    await fill(self.psubs[base], msgs, window, 0.0)
            except Exception as exc:
                self.on_pull_error(base, exc)
            self._arrivals.observe(len(msgs), now)
            pulled = await self.admit(base, msgs)
            batches = form_batches(pulled, self.profile_for, self.mixed_bases, self.max_batch_adapters)
            if not batches:
                self.slots.release()
                continue
            self.phase = "hold"
            for i, batch in enumerate(batches):  # several when tasks need several batches (adapters, caps)
                if i:
                    await self.slots.acquire()
                self._seq += 1
                batch.seq = self._seq
                self.service_rates[batch.base].begin()  # ends when the batch is settled (connection._complete)
                self.handoff(batch)

    async def _next_head(self) -> tuple[str, Any] | None:
        """(base, message) of the oldest task held as a head, waiting for one when none is held."""
        if not self._heads:
            for base in self.bases:
                if base not in self._waiters:
                    self._waiters[base] = asyncio.create_task(self._wait_one(base))
            await asyncio.wait(list(self._waiters.values()), return_when=asyncio.FIRST_COMPLETED)
        for base, waiter in list(self._waiters.items()):
            if waiter.done():
                del self._waiters[base]
                msg = waiter.result()  # _wait_one does not raise
                if msg is not None:
                    self._heads[base] = msg
        if not self._heads:
            return None
        base = min(self._heads, key=lambda b: stream_seq(self._heads[b]))  # one stream: lower is older
        return base, self._heads.pop(base)

    async def _wait_one(self, base: str) -> Any | None:
        try:
            msg = await wait_first(self.psubs[base])
        except Exception as exc:  # reconnecting, or the consumer is missing (the keeper re-creates it)
            self.on_pull_error(base, exc)
            await asyncio.sleep(0.5)
            return None
        if msg is not None:
            self.held.add(msg)  # kept alive (in_progress) until a slot takes it
        return msg

    async def give_back_waiting(self) -> None:
        """At shutdown: tasks that a waiter brought but no slot took go back to the queue at once."""
        waiters, self._waiters = self._waiters, {}
        if waiters:
            await asyncio.wait(list(waiters.values()), timeout=IDLE_POLL_S + 2.0)
        left = list(self._heads.items())
        self._heads = {}
        for base, waiter in waiters.items():
            if not waiter.done():
                waiter.cancel()
            elif waiter.result() is not None:
                left.append((base, waiter.result()))
        await self.settler.settle_many([Settlement(msg, base, Situation.SHUTDOWN,
                                                   reason="worker shut down before taking the task")
                                        for base, msg in left])

    def resume(self, batch: Batch) -> None:
        """Rows that waited for an adapter fetch (compute.py) go to the main thread again once a slot is free.

        They hold no slot while they wait (a download must not stop the other bases), so they take one now."""
        task = asyncio.create_task(self._resume(batch))
        self._resuming.add(task)
        task.add_done_callback(self._resuming.discard)

    async def _resume(self, batch: Batch) -> None:
        await self.slots.acquire()
        items = [p for p in batch.items if p.msg in self.held]  # a drain that timed out gave some back already
        if not items:
            self.slots.release()
            return
        self._seq += 1
        batch = replace(batch, items=items, seq=self._seq)
        self.service_rates[batch.base].begin()
        self.handoff(batch)

    async def admit(self, base: str, msgs: list[Any]) -> list[Pulled]:
        """Decode and hold each message; malformed, expired and orphaned tasks are settled here (intake.py)."""
        return await self.intake.admit(base, msgs)
