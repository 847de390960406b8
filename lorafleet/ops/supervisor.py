"""The local supervisor: a part of the cluster that exits is started again, with back-off.

One thread polls the parts of a `LocalCluster` (workers, the gateway, nats-server). A part that
exits is restarted after `RestartPolicy.delay(n)`: 0.5 s, doubling per consecutive quick failure,
at most 30 s; a part that ran for `stable_s` before it failed starts again from the shortest delay,
so a crash loop backs off and a rare crash heals at once. Restarts and exit codes are recorded
in the cluster's state file, which `lorafleet status` shows.

The cluster does the starting (`LocalCluster.respawn`); this module only decides when.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)

POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    first_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    stable_s: float = 30.0  # a part that ran this long before exiting counts as healthy: back-off starts over

    def delay(self, quick_failures: int) -> float:
        """Seconds to wait before the restart that follows `quick_failures` (≥ 1) quick exits in a row."""
        return min(self.first_s * self.factor ** max(quick_failures - 1, 0), self.max_s)


class Supervised(Protocol):
    """What the supervisor needs of a cluster (LocalCluster implements it)."""

    def part_exit_codes(self) -> dict[str, int | None]: ...  # name → exit code, None while running

    def respawn(self, name: str) -> None: ...

    def record_restart(self, name: str, code: int) -> None: ...


@dataclass
class _Part:
    started: float
    quick_failures: int = 0
    restart_at: float | None = None
    code: int = 0


@dataclass
class Supervisor:
    cluster: Supervised
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    on_event: Callable[[str], None] | None = None
    clock: Callable[[], float] = time.monotonic
    _parts: dict[str, _Part] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self._run, name="lorafleet-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _say(self, text: str) -> None:
        if self.on_event is not None:
            self.on_event(text)
        else:
            log.warning("%s", text)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.step()
            except Exception:  # the supervisor must outlive any one failed restart
                log.exception("supervisor step failed")

    def step(self) -> None:
        """One look at every part: note exits, restart those whose back-off has passed."""
        now = self.clock()
        for name, code in self.cluster.part_exit_codes().items():
            part = self._parts.setdefault(name, _Part(started=now))
            if code is None:
                if part.restart_at is not None:  # it came back by itself (restarted by hand): nothing to do
                    part.restart_at, part.started = None, now
                continue
            if part.restart_at is None:  # newly exited
                ran = now - part.started
                part.quick_failures = 1 if ran >= self.policy.stable_s else part.quick_failures + 1
                part.code = code
                part.restart_at = now + self.policy.delay(part.quick_failures)
                self._say(f"{name} exited with code {code} after {ran:.1f}s; restarting in "
                          f"{part.restart_at - now:.1f}s")
                continue
            if now >= part.restart_at and not self._stop.is_set():
                part.restart_at = None
                part.started = now
                # Recorded first: the part starts with its restart count (LORAFLEET_RESTARTS) and tells it.
                self.cluster.record_restart(name, part.code)
                self.cluster.respawn(name)
                self._say(f"{name} restarted")
