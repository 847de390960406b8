"""Which bases have a live worker, and how fast they serve, from heartbeats (never used for routing).

Liveness answers 503 (no worker) and feeds /readyz; the service rates the workers measured
(`Heartbeat.service_rates`, tasks per busy second) add up to a base's capacity, which admission
control divides the backlog by. A worker lists only the bases it can pull for right now (its
consumer exists), so a base whose consumer vanished has no live worker until it is re-created.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lorafleet.core.wire import Heartbeat


@dataclass(slots=True)
class WorkerSeen:
    bases: tuple[str, ...]
    draining: bool
    seen: float  # time.monotonic() when the heartbeat arrived (the worker's clock may differ from ours)
    rates: dict[str, float] = field(default_factory=dict)


class WorkerRegistry:
    def __init__(self, liveness_s: float) -> None:
        self.liveness_s = liveness_s
        self._workers: dict[str, WorkerSeen] = {}

    def observe(self, hb: Heartbeat, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._workers[hb.worker] = WorkerSeen(tuple(hb.bases), hb.draining, now, dict(hb.service_rates))

    def _live(self, now: float) -> list[WorkerSeen]:
        horizon = now - self.liveness_s
        # Forget workers long gone so the table stays as small as the fleet.
        for wid in [w for w, s in self._workers.items() if s.seen < horizon - 60.0]:
            del self._workers[wid]
        return [s for s in self._workers.values() if s.seen >= horizon and not s.draining]

    def serves(self, base: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        horizon = now - self.liveness_s
        return any(s.seen >= horizon and not s.draining and base in s.bases for s in self._workers.values())

    def live_counts(self, bases: list[str] | tuple[str, ...], now: float | None = None) -> dict[str, int]:
        now = time.monotonic() if now is None else now
        live = self._live(now)
        return {b: sum(1 for s in live if b in s.bases) for b in bases}

    def service_rate(self, base: str, now: float | None = None) -> float | None:
        """Tasks per second the live workers of `base` complete together; None until one has measured it."""
        now = time.monotonic() if now is None else now
        horizon = now - self.liveness_s
        rates = [s.rates[base] for s in self._workers.values()
                 if s.seen >= horizon and not s.draining and base in s.bases and base in s.rates]
        return sum(rates) if rates else None
