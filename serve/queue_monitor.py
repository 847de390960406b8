"""What the gateway knows of the queue: the work stream and each base's consumer, read every `monitor_s`.

Three uses: admission control (the backlog per base), readiness (the stream and every base's
consumer exist, and someone pulls from a consumer that has tasks waiting) and healing (a stream
that vanished comes back: admin's layout keeper creates it, lorafleet/ops/layout.py; a gateway with a
credential may not create streams, so it waits, and only on a server without authentication does it
create a missing one itself, `create_missing`). A stream seen with a new creation time was made again:
`on_recreated` runs (the fleet bucket may have gone with it). A publish that finds no stream asks for
a check at once (`trigger`).

The backlog of a base is what its consumer reports (waiting + delivered, not yet acked) at the
last read, with this gateway's own share replaced by its exact count now, so the estimate follows
this gateway's publishes between reads and other gateways' at every read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from lorafleet.core.config import FleetConfig
from lorafleet.nats.queue import ConsumerState, consumer_state, ensure_fleet_streams, stream_created

log = logging.getLogger("lorafleet.serve")


@dataclass(slots=True)
class BaseQueue:
    consumer: ConsumerState
    others: int  # tasks of other gateways (or orphans) in the backlog at the last read
    stalled_reads: int = 0  # consecutive reads with tasks waiting, none delivered and nobody pulling

    @property
    def pulling(self) -> bool:
        """False once tasks have waited with no pull and nothing delivered, at two reads in a row."""
        return self.stalled_reads < 2


class QueueMonitor:
    def __init__(self, fleet: FleetConfig, bases: tuple[str, ...], outstanding: Callable[[str], int],
                 on_recreated: Callable[[], Awaitable[None]] | None = None, *, create_missing: bool = False) -> None:
        self.fleet = fleet
        self.bases = bases
        self.outstanding = outstanding  # this gateway's own unanswered tasks per base (PendingTable)
        self.on_recreated = on_recreated  # after the streams were created again (the fleet bucket may be gone too)
        self.create_missing = create_missing  # only without authentication (see the module's docstring)
        self.stream_exists = False
        self._created: str | None = None  # the work stream's creation time at the last read that found it
        self._missing_logged = False
        self.read_ok = False  # the last read succeeded (NATS answered)
        self.queues: dict[str, BaseQueue] = {b: BaseQueue(ConsumerState(False), 0) for b in bases}
        self.recreated = 0
        self._trigger = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def backlog(self, base: str) -> int:
        q = self.queues.get(base)
        return (q.others if q is not None else 0) + self.outstanding(base)

    def lag(self, base: str) -> int:
        """The consumer's own count at the last read (waiting + delivered, not acked): every gateway's tasks."""
        q = self.queues.get(base)
        return q.consumer.backlog if q is not None else 0

    def consumer_present(self, base: str) -> bool:
        q = self.queues.get(base)
        return bool(self.stream_exists and q is not None and q.consumer.exists)

    def trigger(self) -> None:
        """Read (and heal) now, not at the next period: a publish found no stream."""
        self._trigger.set()

    def start(self, js: Any) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(js), name="lorafleet-queue-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _run(self, js: Any) -> None:
        while True:
            try:
                await self.read(js)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS reconnecting: readiness says so, the next read tries again
                self.read_ok = False
                log.debug("reading the queue state failed: %r", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._trigger.wait(), self.fleet.gateway.monitor_s)
            self._trigger.clear()

    async def read(self, js: Any) -> None:
        """One read of the stream and every consumer (and, with `create_missing`, the streams when missing)."""
        queue = self.fleet.queue
        created = await stream_created(js, queue.stream)
        if created is None:
            if not self._missing_logged:  # once per loss, not at every read while it lasts
                self._missing_logged = True
                log.warning("work stream %s is missing; %s", queue.stream, "creating it" if self.create_missing
                            else "waiting for it (the admin credential's layout keeper creates it)")
            if self.create_missing:
                await ensure_fleet_streams(js, self.fleet, update=False)
                created = await stream_created(js, queue.stream)
        exists = created is not None
        if exists and self._created is not None and created != self._created:
            self.recreated += 1
            log.info("work stream %s is back; workers re-create their consumers", queue.stream)
            if self.on_recreated is not None:
                await self.on_recreated()
        if exists:
            self._created, self._missing_logged = created, False
        self.stream_exists = exists
        states = await asyncio.gather(*(consumer_state(js, queue, b) for b in self.bases)) if exists else \
            [ConsumerState(False)] * len(self.bases)
        for base, state in zip(self.bases, states, strict=True):
            mine = self.outstanding(base)
            stalled = state.exists and state.pending > 0 and state.ack_pending == 0 and state.waiting_pulls == 0
            prev = self.queues[base]
            self.queues[base] = BaseQueue(state, max(state.backlog - mine, 0),
                                          prev.stalled_reads + 1 if stalled else 0)
        self.read_ok = True
