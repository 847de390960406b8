"""Adaptive pull: return at once with a backlog, wait a few ms only when more work is likely.

nats-py's `fetch(n, timeout)` waits the whole timeout when fewer than n messages exist, so a
pull cycle is a sequence of steps (MEASURED.md): a blocking `fetch(1)` to wait for work
(`wait_first`), then `fetch(min(room, num_pending))` only while the server reports a backlog,
and at most one wait of `max_wait_ms` to let an idle queue fill the batch (`fill`).
`next_fetch` is the pure decision.

A worker with a batch time budget (`max_batch_ms`) also caps each pull at what its own measured
speed computes within the budget (`BatchTime`). On a shared queue this is what makes a slower
worker take less: the tasks it leaves stay in the queue for a faster peer, where a push router
would have committed them to the slow worker's own queue.

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
TIME_DECAY = 0.9  # weight of a batch-time observation per newer one: the fit follows about the last 10 batches


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


class BatchTime:
    """Compute time of a batch of n on this worker, fitted as a + b·n from recent batches (decayed least squares).

    Measured, not configured: it sees this machine, this model, the current adapter mix, and a
    slower peer sees its own, larger cost. Pure arithmetic; one per base.
    """

    __slots__ = ("_s0", "_sd", "_sn", "_snd", "_snn", "decay")

    def __init__(self, decay: float = TIME_DECAY) -> None:
        self.decay = decay
        self._s0 = self._sn = self._sd = self._snn = self._snd = 0.0

    def observe(self, n: int, seconds: float) -> None:
        if n < 1 or not seconds >= 0.0:  # also rejects NaN
            return
        k = self.decay
        self._s0 = k * self._s0 + 1.0
        self._sn = k * self._sn + n
        self._sd = k * self._sd + seconds
        self._snn = k * self._snn + n * n
        self._snd = k * self._snd + n * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) in seconds, or None before the first batch.

        With too little spread in n to separate a from b (a worker that always runs batches of one
        size), the whole time is charged per item (a = 0): that overstates larger batches, so a cap
        derived from it errs small, and it stays exact at the size actually seen.
        """
        fit = self._fit()
        return None if fit is None else (fit[0], fit[1])

    def _fit(self) -> tuple[float, float, bool] | None:
        if self._s0 <= 0.0:
            return None
        mn, md = self._sn / self._s0, self._sd / self._s0
        var = self._snn / self._s0 - mn * mn
        if var >= 0.1:  # sizes spread enough to separate a from b (a 1-or-2 mix qualifies)
            b = (self._snd / self._s0 - mn * md) / var
            a = md - b * mn
            if a >= 0.0 and b > 0.0:
                return a, b, True
        return 0.0, md / mn, False

    def max_items(self, budget_s: float, cap: int) -> int:
        """The most items (1..cap) whose predicted time fits `budget_s`; `cap` before any observation.

        Without a two-point fit the per-item estimate would keep a worker at the one size it has
        seen (a fixed cost charged per item looks like a high per-item cost), so while that size
        fits the budget the cap also allows one item more: the larger batch gives the fit its spread.
        """
        fit = self._fit()
        if fit is None:
            return cap
        a, b, exact = fit
        n = int((budget_s - a) / b) if b > 0.0 else cap
        if not exact:
            seen = self._sn / self._s0
            if self._sd / self._s0 <= budget_s:
                n = max(n, int(seen) + 1)
        return max(1, min(cap, n))


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

