"""Requests awaiting their results: request id → one slot per input, one future per request.

Results are at-least-once: a second result for a filled slot is a duplicate, a result for a
request that is gone (answered, failed, timed out) is late; both are dropped and counted.
Every request is resolved by its deadline: a timer per request resolves it with TIMEOUT.
"""

from __future__ import annotations

import asyncio
from typing import Final

from lorafleet.core.wire import Result

# What deliver() did with a result.
FILLED: Final = "filled"  # stored; more inputs outstanding
COMPLETE: Final = "complete"  # stored; the request has all its results
FAILED: Final = "failed"  # an error result: the request is answered with it
DUPLICATE: Final = "duplicate"  # slot already filled
LATE: Final = "late"  # no such request (any more)
MALFORMED: Final = "malformed"  # index out of range

TIMEOUT: Final = "timeout"  # the future's value when the deadline passed


class PendingRequest:
    """One request's slots; `future` resolves to None (all slots filled), the failing Result, or TIMEOUT."""

    __slots__ = ("base", "filled", "future", "n", "request_id", "results", "timer")

    def __init__(self, request_id: str, base: str, n: int, future: asyncio.Future[object]) -> None:
        self.request_id = request_id
        self.base = base
        self.n = n
        self.results: list[Result | None] = [None] * n
        self.filled = 0
        self.future = future
        self.timer: asyncio.TimerHandle | None = None

    @property
    def outstanding(self) -> int:
        return self.n - self.filled


class PendingTable:
    def __init__(self) -> None:
        self._pending: dict[str, PendingRequest] = {}
        self._outstanding: dict[str, int] = {}  # base → tasks published and not yet answered (admission)

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._pending

    def add(self, request_id: str, base: str, n: int, timeout_s: float) -> PendingRequest:
        """Register a request before its tasks are published (a fast worker may answer at once)."""
        loop = asyncio.get_running_loop()
        pending = PendingRequest(request_id, base, n, loop.create_future())
        pending.timer = loop.call_later(max(timeout_s, 0.0), self._expire, request_id)
        self._pending[request_id] = pending
        self._outstanding[base] = self._outstanding.get(base, 0) + n
        return pending

    def get(self, request_id: str) -> PendingRequest | None:
        return self._pending.get(request_id)

    def discard(self, request_id: str) -> None:
        """Forget a request (answered, failed or abandoned); its later results count as late."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        if pending.timer is not None:
            pending.timer.cancel()
        self._outstanding[pending.base] -= pending.outstanding

    def deliver(self, request_id: str, result: Result) -> str:
        pending = self._pending.get(request_id)
        if pending is None:
            return LATE
        i = result.index
        if not 0 <= i < pending.n:
            return MALFORMED
        if pending.results[i] is not None:
            return DUPLICATE
        pending.results[i] = result
        pending.filled += 1
        self._outstanding[pending.base] -= 1
        if result.error_code is not None:
            self._finish(pending, result)
            return FAILED
        if pending.filled == pending.n:
            self._finish(pending, None)
            return COMPLETE
        return FILLED

    def tasks_in_flight(self) -> int:
        return sum(p.outstanding for p in self._pending.values())

    def outstanding(self, base: str) -> int:
        """Tasks of `base` this gateway published and awaits (O(1): kept by add, deliver and discard)."""
        return self._outstanding.get(base, 0)

    def _finish(self, pending: PendingRequest, value: object) -> None:
        self.discard(pending.request_id)
        if not pending.future.done():
            pending.future.set_result(value)

    def _expire(self, request_id: str) -> None:
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.timer = None
            self._finish(pending, TIMEOUT)
