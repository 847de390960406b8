"""Adaptive pull: return at once with a backlog, wait a few ms when idle.

nats-py's `fetch(n, timeout)` waits the whole timeout when fewer than n messages exist, so a
pull cycle is a sequence of steps (MEASURED.md): a blocking `fetch(1)` to wait for work, then
`fetch(min(room, num_pending))` only while the server reports a backlog, and at most one wait
of `max_wait_ms` to let an idle queue fill the batch. `next_fetch` is the pure decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IDLE_POLL_S = 0.5  # blocking fetch(1); bounds how long a stop request waits for the pull to return
BACKLOG_TIMEOUT_S = 0.02  # a backlog fetch returns as soon as its messages arrive; this caps a stale count
MIN_TIMEOUT_S = 0.001  # nats-py subtracts 0.1 ms from the timeout for the server-side expiry


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


def pending_of(msg: Any) -> int:
    try:
        return int(msg.metadata.num_pending or 0)
    except Exception:  # a message without JetStream metadata: assume no backlog
        return 0


async def pull_cycle(psub: Any, cap: int, max_wait_ms: float, idle_poll_s: float = IDLE_POLL_S) -> list[Any]:
    """One cycle: [] after an idle poll, else 1..cap messages gathered without needless waiting."""
    try:
        msgs = list(await psub.fetch(1, timeout=idle_poll_s))
    except TimeoutError:  # nats.errors.TimeoutError subclasses it
        return []
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
