"""This worker's measured service rate per base: tasks completed per second of being busy with that base.

Busy means at least one batch of the base handed to the main thread and not yet settled, so the
figure includes everything between a pull and its acks (compute, replies, settling), and an idle
worker's waiting does not dilute it. The first batch is left out: it pays for warming up (lazy
initialisation, the first kernels), seconds on a CPU, and would make the worker look ten times
slower. Both sums decay with the same time constant, so an idle period keeps the last estimate
instead of eroding it. Published in heartbeats (`Heartbeat.service_rates`); gateways add their
workers' rates up to decide what they can still promise (admission control).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

WINDOW_S = 10.0  # time constant: the estimate follows the last ten or so seconds of busy time


class ServiceRate:
    """Decayed tasks / decayed busy seconds for one base. Pure arithmetic; one per base."""

    __slots__ = ("_active", "_busy", "_last", "_tasks", "_warm", "clock", "window_s")

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._warm = False  # the first batch has been left out
        self._active = 0
        self._busy = 0.0
        self._tasks = 0.0
        self._last: float | None = None

    def _advance(self, now: float) -> None:
        if self._last is not None:
            dt = max(now - self._last, 0.0)
            if self._active > 0:
                self._busy += dt
            k = math.exp(-dt / self.window_s)
            self._busy *= k
            self._tasks *= k
        self._last = now

    def begin(self) -> None:
        """A batch of this base was handed to the main thread."""
        self._advance(self.clock())
        self._active += 1

    def end(self, tasks: int) -> None:
        """That batch was settled; `tasks` of it were computed."""
        self._advance(self.clock())
        self._active = max(self._active - 1, 0)
        if not self._warm:  # the warm-up batch: forget it
            self._warm = True
            self._busy = self._tasks = 0.0
            return
        self._tasks += max(tasks, 0)

    def per_s(self) -> float | None:
        """Tasks per busy second, or None before a batch was computed."""
        self._advance(self.clock())
        if self._busy <= 1e-6 or self._tasks <= 0.0:
            return None
        return self._tasks / self._busy
