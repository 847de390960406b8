"""Adaptive pull: return at once with a backlog, wait a few ms only when more work is likely.

nats-py's `fetch(n, timeout)` waits the whole timeout when fewer than n messages exist, so a
pull cycle is a sequence of steps (MEASURED.md): a blocking `fetch(1)` to wait for work
(`wait_first`), then `fetch(min(room, num_pending))` only while the server reports a backlog,
and at most one wait of `max_wait_ms` to let an idle queue fill the batch (`fill`).
`next_fetch` is the pure decision.

The fill wait is adaptive: it is taken only when the recent arrival rate makes at least one more
task likely within it (`ArrivalRate.worth_waiting`). At low load (one client at a time) a wait
would add its full length to every request and gather nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

IDLE_POLL_S = 0.25  # blocking fetch(1); bounds a stop request's wait and how long an unneeded pull stays open
BACKLOG_TIMEOUT_S = 0.02  # a backlog fetch returns as soon as its messages arrive; this caps a stale count
MIN_TIMEOUT_S = 0.001  # nats-py subtracts 0.1 ms from the timeout for the server-side expiry
RATE_WINDOW_S = 1.0  # time constant of the arrival-rate estimate
FILL_MIN_EXPECTED = 0.5  # wait for more only when this many further arrivals are expected within the wait


@dataclass(frozen=True, slots=True)
class FetchStep:
    n: int
    timeout_s: float
    fill_wait: bool = False  # this step is the one idle wait for more tasks


def next_fetch(got: int, cap: int, num_pending: int, waited: bool, max_wait_ms: float) -> FetchStep | None:
    """The next fetch of a pull cycle that already holds `got` messages, or None to stop.

    `num_pending` is the last message's metadata.num_pending (messages left in the consumer).
    """
    room = cap - got
    if room <= 0:
        return None
    if num_pending > 0:
        return FetchStep(min(room, num_pending), BACKLOG_TIMEOUT_S)
    if not waited and max_wait_ms > 0:
        return FetchStep(room, max(max_wait_ms / 1000.0, MIN_TIMEOUT_S), fill_wait=True)
    return None


class ArrivalRate:
    """Exponentially decayed count of pulled tasks: an estimate of tasks per second that needs no clock thread."""

    __slots__ = ("_last", "_level", "window_s")

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._level = 0.0  # tasks per second as of `_last`
        self._last = 0.0

    def observe(self, n: int, now: float) -> None:
        self._level = self.per_s(now) + n / self.window_s
        self._last = now

    def per_s(self, now: float) -> float:
        return self._level * math.exp(-max(now - self._last, 0.0) / self.window_s)

    def worth_waiting(self, max_wait_ms: float, now: float) -> bool:
        """Whether at least FILL_MIN_EXPECTED more tasks are expected within `max_wait_ms`."""
        return max_wait_ms > 0 and self.per_s(now) * max_wait_ms / 1000.0 >= FILL_MIN_EXPECTED


def pending_of(msg: Any) -> int:
    try:
        return int(msg.metadata.num_pending or 0)
    except Exception:  # a message without JetStream metadata: assume no backlog
        return 0


async def wait_first(psub: Any, idle_poll_s: float = IDLE_POLL_S) -> Any | None:
    """Block until one task arrives (its message) or `idle_poll_s` passes (None)."""
    try:
        msgs = await psub.fetch(1, timeout=idle_poll_s)
    except TimeoutError:  # nats.errors.TimeoutError subclasses it
        return None
    return msgs[0] if msgs else None


async def fill(psub: Any, msgs: list[Any], cap: int, max_wait_ms: float) -> list[Any]:
    """Add to `msgs` (non-empty) the backlog and, if `max_wait_ms` > 0, what arrives within one wait."""
    waited = False
    while True:
        step = next_fetch(len(msgs), cap, pending_of(msgs[-1]), waited, max_wait_ms)
        if step is None:
            return msgs
        waited = waited or step.fill_wait
        try:
            more = await psub.fetch(step.n, timeout=step.timeout_s)
        except TimeoutError:  # nats.errors.TimeoutError subclasses it
            more = []
        if not more:
            return msgs
        msgs.extend(more)

