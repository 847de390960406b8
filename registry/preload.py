"""Preload on promote: every live worker of a base loads the new version before the fleet switches to it.

`promote` writes the version's entry under a staged key (`fleet_state.preload_key`: workers turn it into a
preload between batches, gateways never route by it), then waits here until every live worker of the base
lists the adapter id among its loaded adapters in its heartbeat; only then is the live entry written, so
no request to the new version waits for a download. Which workers are live is learnt from heartbeats:
the first `listen_s` (longer than one heartbeat period) gathers them, a worker heard later joins, one
that drains or falls silent for `stale_s` drops out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from lorafleet.core import heartbeats
from lorafleet.core.wire import Heartbeat

DEFAULT_PRELOAD_TIMEOUT_S = 120.0


def listen_window(heartbeat_s: float) -> float:
    """How long to listen before the set of live workers is known: every worker speaks once per heartbeat_s."""
    return 1.5 * heartbeat_s + 0.5


@dataclass
class PreloadTracker:
    """Pure bookkeeping of the heartbeats heard during a preload (the clock is passed in)."""

    base: str
    adapter_id: str
    stale_s: float
    heard: dict[str, tuple[float, Heartbeat]] = field(default_factory=dict)  # worker → (when heard, latest)

    def observe(self, hb: Heartbeat, now: float) -> None:
        self.heard[hb.worker] = (now, hb)

    def workers(self, now: float) -> list[str]:
        """Live workers of the base: heard within stale_s, not draining, pulling for the base."""
        return sorted(w for w, (t, hb) in self.heard.items()
                      if now - t <= self.stale_s and not hb.draining and self.base in hb.bases)

    def confirmed(self, now: float) -> list[str]:
        return [w for w in self.workers(now) if self.adapter_id in self.heard[w][1].adapters.get(self.base, [])]


@dataclass
class PreloadResult:
    adapter_id: str
    workers: list[str]
    confirmed: list[str]
    seconds: float

    @property
    def missing(self) -> list[str]:
        return [w for w in self.workers if w not in self.confirmed]

    @property
    def complete(self) -> bool:
        return not self.missing


async def wait_preloaded(nc: Any, base: str, adapter_id: str, *, timeout_s: float, heartbeat_s: float = 1.0,
                         progress: Callable[[str], None] | None = None,
                         started: Callable[[], Awaitable[object]] | None = None) -> PreloadResult:
    """Listen to heartbeats until every live worker of `base` lists `adapter_id`, or `timeout_s` passes.

    `started` (a coroutine function) runs once the subscription is in place: it writes the staged entry,
    so no heartbeat that confirms it can be missed."""
    tracker = PreloadTracker(base, adapter_id, stale_s=3 * heartbeat_s + 1.0)
    heard = asyncio.Event()

    def on_hb(hb: Heartbeat) -> None:
        tracker.observe(hb, time.monotonic())
        heard.set()

    t0 = time.monotonic()
    listen_until = t0 + min(listen_window(heartbeat_s), timeout_s)
    deadline = t0 + max(timeout_s, 0.0)
    sub = await heartbeats.subscribe(nc, on_hb)
    try:
        if started is not None:
            await started()
        said: tuple[int, int] | None = None
        while True:
            now = time.monotonic()
            workers, confirmed = tracker.workers(now), tracker.confirmed(now)
            if progress is not None and workers and (len(confirmed), len(workers)) != said:
                said = (len(confirmed), len(workers))
                progress(f"preloading {adapter_id}: workers confirmed {said[0]}/{said[1]}")
            if (now >= listen_until and len(confirmed) == len(workers)) or now >= deadline:
                return PreloadResult(adapter_id, workers, confirmed, now - t0)
            heard.clear()
            wake = min(listen_until if now < listen_until else deadline, now + heartbeat_s)  # stale workers
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(heard.wait(), max(wake - now, 0.0) + 0.01)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
