"""The ack table: what a worker does with a task in each situation, written down as data.

Every task leaves a worker through exactly one row of `ACK_TABLE`: which reply (if any) goes to
the gateway's inbox, whether the payload goes to the dead-letter stream, and how the JetStream
message is settled (ack / nak with delay / term). The row depends on the situation and on
whether this delivery is the last one the consumer will make (num_delivered >= max_deliver).

A task whose gateway is gone (no subscriber on its reply inbox for longer than a reconnect takes)
is dropped before it is computed: its answer could only be thrown away. While the gateway is only
away (within `worker.orphan_grace_s`) the task is retried, its deliveries spread over the grace
(`away_retry_delay`), so it is never dropped at its last delivery before the grace has passed.

Adapter failures are split in two on purpose: an adapter that cannot exist for this worker
(unknown URI scheme, missing directory, invalid adapter files) fails the same way on every
delivery, so it is answered and dead-lettered at once; any other load error (out of memory,
I/O hiccup) is treated as transient and retried like a failed batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from lorafleet.core.wire import ERR_ADAPTER, ERR_DEADLINE, ERR_INVALID, ERR_MALFORMED, ERR_RUNTIME


class Situation(StrEnum):
    OK = "ok"  # the vector (or text) was computed
    DEADLINE = "deadline"  # the task's deadline had passed before compute
    MALFORMED = "malformed"  # the body is not a Task (wire.MalformedTask)
    ADAPTER_UNAVAILABLE = "adapter_unavailable"  # permanent: the adapter cannot be resolved or is invalid
    ADAPTER_FAILED = "adapter_failed"  # transient: loading raised something else
    RUNTIME_FAILED = "runtime_failed"  # the batch (and the task alone) raised during encode
    SHUTDOWN = "shutdown"  # drain timed out before the task was computed
    UNDELIVERED = "undelivered"  # computed, but no gateway confirmed the result (it was reconnecting)
    OWNER_AWAY = "owner_away"  # nobody listens on the task's reply inbox just now: not computed, retried later
    ORPHANED = "orphaned"  # the gateway that owns the task is gone (away past the grace): dropped uncomputed
    CANCELLED = "cancelled"  # generation stopped because nobody wants the text any more (client gone)
    INVALID = "invalid"  # the runtime refused the input or its parameters: the same on every delivery


class Settle(StrEnum):
    ACK = "ack"
    NAK = "nak"
    TERM = "term"


REPLY_RESULT = "result"  # marker: reply with the computed vector (or text)


@dataclass(frozen=True, slots=True)
class Action:
    reply: str | None  # REPLY_RESULT, an error code from wire, or None (no reply)
    settle: Settle
    dead_letter: bool = False
    nak_delay: bool = False  # nak after QueueConfig.nak_delay_s rather than at once


_RESULT_ACK = Action(REPLY_RESULT, Settle.ACK)
_DEADLINE_ACK = Action(ERR_DEADLINE, Settle.ACK)
_RETRY = Action(None, Settle.NAK, nak_delay=True)

_CANCELLED = Action(None, Settle.ACK)
_INVALID = Action(ERR_INVALID, Settle.ACK)  # answered (400) and done: the request was the problem, not the fleet

# (situation, is_last_delivery) → action
ACK_TABLE: dict[tuple[Situation, bool], Action] = {
    (Situation.OK, False): _RESULT_ACK,
    (Situation.OK, True): _RESULT_ACK,
    (Situation.DEADLINE, False): _DEADLINE_ACK,
    (Situation.DEADLINE, True): _DEADLINE_ACK,
    (Situation.MALFORMED, False): Action(ERR_MALFORMED, Settle.TERM, dead_letter=True),
    (Situation.MALFORMED, True): Action(ERR_MALFORMED, Settle.TERM, dead_letter=True),
    (Situation.ADAPTER_UNAVAILABLE, False): Action(ERR_ADAPTER, Settle.TERM, dead_letter=True),
    (Situation.ADAPTER_UNAVAILABLE, True): Action(ERR_ADAPTER, Settle.TERM, dead_letter=True),
    (Situation.ADAPTER_FAILED, False): _RETRY,
    (Situation.ADAPTER_FAILED, True): Action(ERR_ADAPTER, Settle.TERM, dead_letter=True),
    (Situation.RUNTIME_FAILED, False): _RETRY,
    (Situation.RUNTIME_FAILED, True): Action(ERR_RUNTIME, Settle.TERM, dead_letter=True),
    # The result did not reach a gateway: keep the task so a later delivery answers it.
    (Situation.UNDELIVERED, False): _RETRY,
    (Situation.UNDELIVERED, True): Action(ERR_RUNTIME, Settle.TERM, dead_letter=True),
    # Nobody waits for the answer: computing it would be thrown away. Away may be a gateway reconnecting
    # (retry later, without computing); gone (or still away at the last delivery) is dropped.
    (Situation.OWNER_AWAY, False): _RETRY,
    (Situation.OWNER_AWAY, True): Action(None, Settle.ACK),
    (Situation.ORPHANED, False): Action(None, Settle.ACK),
    (Situation.ORPHANED, True): Action(None, Settle.ACK),
    # Its gateway said nobody waits (client disconnected, request gone): stop, answer nothing.
    (Situation.CANCELLED, False): _CANCELLED,
    (Situation.CANCELLED, True): _CANCELLED,
    (Situation.INVALID, False): _INVALID,
    (Situation.INVALID, True): _INVALID,
    # Draining worker gives the task back at once so another worker takes it without delay.
    (Situation.SHUTDOWN, False): Action(None, Settle.NAK),
    (Situation.SHUTDOWN, True): Action(ERR_RUNTIME, Settle.TERM, dead_letter=True),
}


def is_last_delivery(num_delivered: int | None, max_deliver: int) -> bool:
    return (num_delivered or 1) >= max_deliver


def decide(situation: Situation, num_delivered: int | None, max_deliver: int) -> Action:
    """The action for one task; `num_delivered` comes from the JetStream message metadata."""
    return ACK_TABLE[(situation, is_last_delivery(num_delivered, max_deliver))]


AWAY_MARGIN_S = 0.05  # the last delivery comes a little after the grace ends, never on its edge


def away_retry_delay(away_s: float, grace_s: float, num_delivered: int | None, max_deliver: int,
                     floor_s: float) -> float:
    """The nak delay of a task whose gateway has been away for `away_s` (a retry, `_RETRY`, not the last delivery).

    Each retry uses a delivery. The deliveries left are spread evenly over what is left of the grace, so the
    last one comes only once the gateway has been away for `grace_s`: back by then, it gets its answer; still
    away, it is gone and the task is dropped (`ORPHANED`). Recomputed on every delivery, with whatever this
    worker knows: one that learnt of the absence later counts from then, which only delays the last delivery.
    Never shorter than `floor_s` (`QueueConfig.nak_delay_s`).
    """
    left = grace_s - away_s
    if left <= 0.0:
        return floor_s
    remaining = max(max_deliver - (num_delivered or 1), 1)  # deliveries after this one
    return max(floor_s, left / remaining + AWAY_MARGIN_S)
