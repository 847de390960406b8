"""Keeping held tasks alive, within bounds.

A worker holds each task it pulled until it settles it, and keeps telling JetStream that it works on
it (`in_progress`, every third of ack_wait) so that nobody else is given it meanwhile. That claim is
bounded, so a task can never be held for ever:

- Not past the task's deadline plus `DEADLINE_GRACE_S`: nobody waits for its answer any more. The
  grace leaves time to settle it here (a generation aborted at its deadline answers with the deadline
  error); a task still held after that is delivered again once ack_wait passes, and whoever takes it
  settles it at intake as expired.
- Not while the compute thread is stuck. `ComputeWatch` follows the batches handed to the worker's
  main thread; once that thread has shown no progress (no batch back, no streamed text) for
  `stuck_after_s` while it holds one, the tasks of every batch in its hands are let go, so JetStream
  delivers them to a healthy worker after ack_wait, and the worker's heartbeats stop listing the bases
  that thread computes (its presence says `stuck`). Redelivery rather than an explicit failure: a
  stuck thread says nothing about the task, and max_deliver still bounds the retries. A thread that
  comes back settles its late results as usual (a gateway drops what it already has) and the worker
  claims its bases again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lorafleet.core.deadlines import local_deadline
from lorafleet.core.wire import Task
from lorafleet.sidecar.batcher import Batch
from lorafleet.sidecar.settle import Held, HeldTable

log = logging.getLogger(__name__)

DEADLINE_GRACE_S = 5.0  # past a task's deadline: time left to settle it here before it is let go
STUCK_MIN_S = 60.0  # the default stuck bound is the larger of this and 6 × ack_wait (a slow batch is no stuck one)


def default_stuck_after(ack_wait_s: float) -> float:
    return max(STUCK_MIN_S, 6.0 * ack_wait_s)


@dataclass(frozen=True, slots=True)
class Hold:
    """Whether one held task is kept alive now, and if not, why (for the log)."""

    extend: bool
    why: str = ""


def decide(deadline: float, wall: float, in_stuck_compute: bool) -> Hold:
    if wall >= deadline + DEADLINE_GRACE_S:
        return Hold(False, "its deadline passed")
    if in_stuck_compute:
        return Hold(False, "the compute thread holding it shows no progress")
    return Hold(True)


class ComputeWatch:
    """The batches in the compute thread's hands, and its last sign of life; the loop decides when it is stuck."""

    def __init__(self) -> None:
        self._batches: dict[int, tuple[float, frozenset[int]]] = {}  # id(batch) → (handed at, ids of its msgs)
        # Written by the compute thread too (`alive`): one float store, atomic under the GIL.
        self.beat = time.monotonic()
        self.stuck = False

    def handed(self, batch: Batch) -> None:
        self._batches[id(batch)] = (time.monotonic(), frozenset(id(p.msg) for p in batch.items))

    def returned(self, batch: Batch) -> None:
        self._batches.pop(id(batch), None)
        self.alive()

    def alive(self) -> None:
        """A sign of progress from the compute thread (a streamed delta, a batch back)."""
        self.beat = time.monotonic()

    def check(self, now: float, stuck_after_s: float) -> bool:
        """Whether the thread is stuck now: it holds a batch and showed nothing since it could have started it."""
        stuck = False
        if self._batches:
            oldest = min(t for t, _ in self._batches.values())  # FIFO: the one being computed
            stuck = now - max(oldest, self.beat) >= stuck_after_s
        if stuck != self.stuck:
            self.stuck = stuck
            if stuck:
                log.error("the compute thread shows no progress for %.0fs with %d batch(es) in its hands; their tasks "
                          "are no longer kept alive (delivered again elsewhere) and heartbeats stop listing their "
                          "bases", stuck_after_s, len(self._batches))
            else:
                log.warning("the compute thread makes progress again")
        return stuck

    def msg_ids(self) -> frozenset[int]:
        return frozenset().union(*(ids for _, ids in self._batches.values()))


class _Known:
    """What the keep-alive remembers of one held message (it keeps the message, so its id stays unique)."""

    __slots__ = ("deadline", "let_go", "msg", "task_id")

    def __init__(self, msg: Any) -> None:
        self.msg = msg
        self.let_go = False
        try:
            task = Task.from_wire(msg.data)
            self.deadline, self.task_id = local_deadline(task, received=time.time()), task.id  # this host's clock
        except Exception:  # malformed: intake settles it at once; nothing to bound it by until then
            self.deadline, self.task_id = float("inf"), "?"


class KeepAlive:
    """Sends in_progress for the held messages that are worth keeping (`decide`), every `every` seconds each."""

    def __init__(self, held: HeldTable, every: float, watch: ComputeWatch, stuck_after: Callable[[], float]) -> None:
        self.held, self.every, self.watch, self.stuck_after = held, every, watch, stuck_after
        self._known: dict[int, _Known] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every / 2)
            await self.tick()

    async def tick(self) -> None:
        now, wall = time.monotonic(), time.time()
        stuck = self.watch.msg_ids() if self.watch.check(now, self.stuck_after()) else frozenset()
        held = self.held.values()
        self._known = {id(h.msg): self._known_of(h) for h in held}  # forgets the settled ones
        for h in held:
            if now - h.last_progress < self.every:
                continue
            known = self._known[id(h.msg)]
            hold = decide(known.deadline, wall, id(h.msg) in stuck)
            if not hold.extend:
                if not known.let_go:
                    known.let_go = True
                    log.info("task %s no longer kept alive: %s (delivered again after ack_wait)", known.task_id,
                             hold.why)
                continue
            known.let_go = False
            h.last_progress = now
            try:
                await h.msg.in_progress()
            except Exception as exc:
                log.debug("in_progress failed: %s", exc)

    def _known_of(self, h: Held) -> _Known:
        known = self._known.get(id(h.msg))
        return known if known is not None and known.msg is h.msg else _Known(h.msg)
