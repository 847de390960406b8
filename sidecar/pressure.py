"""Queue pressure per base, read from JetStream: what the placement decision (placement.py) weighs.

Per base: the shared consumer's info gives the tasks not yet delivered and those in flight; the first
undelivered task (next by subject after the consumer's delivered sequence) gives the age of the oldest
wait from its stream timestamp. A base whose consumer does not exist yet (nobody ever held it) counts
every task of its subject as waiting, from the stream's per-subject totals. Tasks redelivered after a
nak sit below the delivered sequence, so the age can be low by their amount: it errs toward patience.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from lorafleet.core.wire import WORK_PREFIX, consumer_name, work_subject
from lorafleet.sidecar.placement import Pressure


async def _oldest_age_s(js: JetStreamContext, stream: str, base: str, after_seq: int, now: float) -> float:
    try:
        msg = await js.get_msg(stream, seq=after_seq + 1, subject=work_subject(base), next=True)
    except NotFoundError:
        return 0.0  # taken between the two reads
    return max(0.0, now - msg.time.timestamp()) if msg.time else 0.0


async def read_pressure(js: JetStreamContext, stream: str, bases: Iterable[str]) -> dict[str, Pressure]:
    """Pressure of each base now; one consumer-info call per base, one message read per waiting base."""
    now = time.time()
    per_subject: dict[str, int] | None = None
    out: dict[str, Pressure] = {}
    for base in bases:
        try:
            info = await js.consumer_info(stream, consumer_name(base))
        except NotFoundError:
            if per_subject is None:
                sinfo = await js.stream_info(stream, subjects_filter=f"{WORK_PREFIX}.>")
                per_subject = dict(sinfo.state.subjects or {})
            waiting = int(per_subject.get(work_subject(base), 0))
            age = await _oldest_age_s(js, stream, base, 0, now) if waiting else 0.0
            out[base] = Pressure(waiting, age, 0)
            continue
        waiting = int(info.num_pending or 0)
        delivered = int(info.delivered.stream_seq or 0) if info.delivered else 0
        age = await _oldest_age_s(js, stream, base, delivered, now) if waiting else 0.0
        out[base] = Pressure(waiting, age, int(info.num_ack_pending or 0))
    return out
