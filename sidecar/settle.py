"""Settling: every task leaves a worker through here — its reply goes to the gateway, its message is settled.

One reply path for every result, success or error: a reply is sent as a core-NATS request to the
task's reply inbox and counts only once the gateway confirms it with a receipt. Core NATS drops a
message nobody is subscribed to, so a gateway that is reconnecting (or a server that just
restarted) would otherwise never see an answer whose task we then ack or terminate. An
unconfirmed reply keeps the task for another delivery (nak with delay) unless nobody waits for
it any more (its deadline passed) or this is its last delivery. Duplicates this can cause are
dropped by the gateway. The table of what to do in each situation is `acks.ACK_TABLE`; each task's
row is decided once (`Plan`), and changes only when its reply went unconfirmed (`after_reply`).

A task whose gateway is away (nobody on its inbox: gone, or reconnecting) is retried with a nak delay
that spreads the deliveries it has left over what remains of `worker.orphan_grace_s`
(`acks.away_retry_delay`): every retry uses a delivery, and the last one must come only once the
grace has passed, so a gateway back within it still gets its answer.

The class talks to NATS only through the message (`ack`, `nak`, `term`, `data`, `metadata`,
`headers`, `subject`) and the connection (`request`) and JetStream (`publish`) objects it is
given, so its logic is unit-tested with small fakes, without a worker process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nats.errors import NoRespondersError

from lorafleet.core.config import QueueConfig
from lorafleet.core.wire import (
    HDR_DLQ_DELIVERIES,
    HDR_DLQ_REASON,
    HDR_DLQ_SUBJECT,
    HDR_MSG_ID,
    Result,
    Task,
    dlq_subject,
    unpack,
)
from lorafleet.sidecar.acks import (
    REPLY_RESULT,
    Action,
    Settle,
    Situation,
    away_retry_delay,
    decide,
    is_last_delivery,
)
from lorafleet.sidecar.batcher import Batch
from lorafleet.sidecar.runtime import Generated

log = logging.getLogger(__name__)

RESULT_RECEIPT_TIMEOUT_S = 2.0  # a gateway confirms a result within ms; longer means it is gone
# Situations that are routine under load or after a gateway died: not worth a warning per task.
_LOG_LEVEL = {Situation.DEADLINE: logging.INFO, Situation.UNDELIVERED: logging.INFO,
              Situation.OWNER_AWAY: logging.DEBUG, Situation.ORPHANED: logging.DEBUG, Situation.CANCELLED: logging.INFO,
              Situation.INVALID: logging.INFO}


@dataclass(slots=True)
class Text:
    """A generated text to answer with, and how many chunks of it were streamed before."""

    generated: Generated
    chunks: int = 0


@dataclass(frozen=True, slots=True)
class Scores:
    """A score task's answer: float32 little-endian bytes, one per document of the task."""

    data: bytes


Payload = bytes | Text | Scores  # an embedding (float32 bytes), a generated text, or relevance scores


@dataclass(slots=True)
class Outcome:
    """What the main thread made of one task of a batch."""

    situation: Situation
    vector: bytes | None = None
    message: str = ""
    text: Text | None = None
    scores: Scores | None = None

    @property
    def payload(self) -> Payload | None:
        if self.vector is not None:
            return self.vector
        return self.text if self.text is not None else self.scores


class Held:
    """A message this worker holds (pulled, not yet settled); kept alive with in_progress."""

    __slots__ = ("last_progress", "msg")

    def __init__(self, msg: Any) -> None:
        self.msg = msg
        self.last_progress = time.monotonic()


class HeldTable:
    """The messages this worker holds, by identity; `wait_empty` lets a drain await the last settle."""

    def __init__(self) -> None:
        self._held: dict[int, Held] = {}
        self._empty = asyncio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, msg: object) -> bool:
        return id(msg) in self._held

    def add(self, msg: Any) -> None:
        self._held.setdefault(id(msg), Held(msg))
        self._empty.clear()

    def discard(self, msg: Any) -> None:
        self._held.pop(id(msg), None)
        if not self._held:
            self._empty.set()

    def values(self) -> list[Held]:
        return list(self._held.values())

    async def wait_empty(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
        except TimeoutError:
            return False
        return True


def num_delivered(msg: Any) -> int:
    try:
        return int(msg.metadata.num_delivered or 1)
    except Exception:
        return 1


def reply_hint(payload: bytes) -> tuple[str, str, int] | None:
    """(reply, id, index) from a body that is not a valid Task, when they can still be read."""
    try:
        d = unpack(payload)
    except Exception:
        return None
    if isinstance(d, dict) and isinstance(d.get("r"), str) and isinstance(d.get("id"), str):
        index = d.get("i")
        return d["r"], d["id"], index if isinstance(index, int) else 0
    return None


def after_reply(action: Action, situation: Situation, delivered: bool, last: bool) -> tuple[Action, str | None]:
    """The action once the reply's fate is known: an unconfirmed reply keeps the task when that can help.

    Returns the action to take and, when it changed, why.
    """
    if delivered or action.reply is None or situation is Situation.DEADLINE:
        return action, None  # confirmed, nothing to confirm, or nobody waits for it any more
    if last:
        # No later delivery can answer it: dead-letter it so it is not lost silently.
        return decide(Situation.UNDELIVERED, 1, 1), "no gateway confirmed the reply on the last delivery"
    return decide(Situation.UNDELIVERED, 1, 2), "no gateway confirmed the reply"


@dataclass(frozen=True, slots=True)
class Settlement:
    """One task to settle: its message, what happened to it, and what to answer with."""

    msg: Any
    base: str
    situation: Situation
    task: Task | None = None  # None when the body is no Task (malformed) or was never decoded (shutdown)
    reason: str = ""  # why, for an error reply, the dead-letter header and the log
    payload: Payload | None = None  # the vector or the text of an OK task
    started: float = field(default_factory=time.time)  # wall clock when compute began: the result's queue time

    @property
    def reply(self) -> str | None:
        """The task's reply inbox, when one can be read."""
        if self.task is not None:
            return self.task.reply
        hint = reply_hint(self.msg.data)
        return hint[0] if hint else None


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do with one task, decided once from its situation and delivery: the ack-table row, the reply."""

    item: Settlement
    deliveries: int
    last: bool  # this is the consumer's last delivery of it
    action: Action
    reply: str | None = None  # the inbox to answer on (None: no reply goes out)
    body: bytes | None = None


class Settler:
    """Replies and settles tasks for one worker connection."""

    def __init__(self, nc: Any, js: Any, queue: QueueConfig, worker_id: str, held: HeldTable,
                 dims: dict[str, int], owners: Any = None,
                 on_settled: Callable[[str, str], None] | None = None) -> None:
        self.nc, self.js, self.queue, self.worker_id = nc, js, queue, worker_id
        self.held = held
        self.dims = dims
        self.owners = owners  # owners.OwnerTracker: learns from each reply whether its gateway listens
        self.on_settled = on_settled  # (base, situation) of every settled task: the worker's metrics
        self.tasks_done = 0

    async def complete(self, batch: Batch, outcomes: Sequence[Outcome], started: float) -> None:
        """Answer and settle every task of a computed batch: replies go out together, then each is settled."""
        await self.settle_many([
            Settlement(item.msg, batch.base, out.situation, item.task, out.message, out.payload, started)
            for item, out in zip(batch.items, outcomes, strict=True)
        ], batch_size=len(batch.items))

    async def settle_many(self, items: Sequence[Settlement], batch_size: int = 0) -> None:
        """Settle several tasks, their replies delivered concurrently (one slow gateway does not serialise them)."""
        plans = [self._plan(item, batch_size) for item in items]
        delivered = await asyncio.gather(*(self._deliver(p.reply, p.body) if p.body is not None else _true()
                                           for p in plans))
        for plan, done in zip(plans, delivered, strict=True):
            await self._finish(plan, done)

    async def settle(self, msg: Any, base: str, situation: Situation, *, task: Task | None = None,
                     reason: str = "", vector: Payload | None = None, started: float | None = None,
                     batch_size: int = 0) -> None:
        await self.settle_many([Settlement(msg, base, situation, task, reason, vector,
                                           time.time() if started is None else started)], batch_size=batch_size)

    # -- steps -------------------------------------------------------------------------------------
    def _plan(self, item: Settlement, batch_size: int = 0) -> Plan:
        """The ack-table row of one task (decided here, once) and the reply to send before settling it."""
        msg, task, situation = item.msg, item.task, item.situation
        deliveries = num_delivered(msg)
        last = is_last_delivery(deliveries, self.queue.max_deliver)
        action = decide(situation, deliveries, self.queue.max_deliver)
        plan = Plan(item, deliveries, last, action)
        if action.reply is None:
            return plan
        target = (task.reply, task.id, task.index) if task else reply_hint(msg.data)
        if target is None:  # not even a reply inbox could be read: nobody to tell
            return plan
        reply, task_id, index = target
        if action.reply == REPLY_RESULT:
            payload = item.payload
            queue_ms = max(item.started - task.enqueued, 0.0) * 1000.0 if task else 0.0
            if isinstance(payload, Text):
                g = payload.generated
                result = Result(task_id, index, self.worker_id, text=g.text, prompt_tokens=g.prompt_tokens,
                                completion_tokens=g.completion_tokens, finish_reason=g.finish_reason,
                                queue_ms=queue_ms, batch_size=batch_size, seq=payload.chunks, attempt=deliveries)
            elif isinstance(payload, Scores):
                result = Result(task_id, index, self.worker_id, scores=payload.data, queue_ms=queue_ms,
                                batch_size=batch_size)
            else:
                result = Result(task_id, index, self.worker_id, vector=payload, dim=self.dims.get(item.base, 0),
                                queue_ms=queue_ms, batch_size=batch_size)
        else:
            result = Result(task_id, index, self.worker_id, error_code=action.reply,
                            error_message=item.reason or situation.value, batch_size=batch_size)
        return Plan(item, deliveries, last, action, reply, result.to_wire())

    async def _deliver(self, reply: str | None, body: bytes | None) -> bool:
        assert reply is not None and body is not None
        try:
            await self.nc.request(reply, body, timeout=RESULT_RECEIPT_TIMEOUT_S)
        except NoRespondersError:  # nobody subscribes to the inbox: its gateway is reconnecting, or gone
            if self.owners is not None:
                self.owners.heard(reply, False)
            log.debug("reply to %s not confirmed: no gateway listens there", reply)
            return False
        except Exception as exc:  # TimeoutError, connection errors
            log.info("reply to %s not confirmed (%s)", reply, type(exc).__name__)
            return False
        if self.owners is not None:
            self.owners.heard(reply, True)
        return True

    def nak_delay(self, plan: Plan, action: Action, situation: Situation) -> float | None:
        """How long a nak'ed task waits: nak_delay_s, stretched while its gateway is away so that its deliveries
        left reach past `orphan_grace_s` (a reconnecting gateway still gets its answer)."""
        if not action.nak_delay:
            return None
        delay = self.queue.nak_delay_s
        if self.owners is None or situation not in (Situation.OWNER_AWAY, Situation.UNDELIVERED):
            return delay
        reply = plan.reply or plan.item.reply
        away = self.owners.away_for(reply) if reply else None
        if away is None:  # not known to be away (an unconfirmed reply that timed out): the usual delay
            return delay
        return away_retry_delay(away, self.owners.grace_s, plan.deliveries, self.queue.max_deliver, delay)

    async def _finish(self, plan: Plan, delivered: bool) -> None:
        item, deliveries = plan.item, plan.deliveries
        msg, base, task, situation, reason = item.msg, item.base, item.task, item.situation, item.reason
        action, why = after_reply(plan.action, situation, delivered, plan.last)
        if why:
            situation, reason = Situation.UNDELIVERED, f"{why} ({situation.value}{': ' + reason if reason else ''})"
        try:
            settle = action.settle
            if action.dead_letter and not await self._dead_letter(msg, base, reason or situation.value, deliveries):
                settle = Settle.NAK  # keep the task rather than lose it; the next delivery tries again
            delay: float | None = None
            if settle is Settle.ACK:
                await msg.ack()
            elif settle is Settle.TERM:
                await msg.term()
            else:
                delay = self.nak_delay(plan, action, situation)
                await msg.nak(delay=delay)
            if settle is not Settle.NAK:
                self.tasks_done += 1
            if situation is not Situation.OK:
                log.log(_LOG_LEVEL.get(situation, logging.WARNING),
                        "task %s: %s → %s%s%s (delivery %d/%d)%s", task.id if task else "?", situation.value,
                        settle.value, f" {delay:.2f}s" if delay else "", " + dead-letter" if action.dead_letter else "",
                        deliveries, self.queue.max_deliver, f": {reason}" if reason else "")
        except Exception as exc:
            log.error("settling a task (%s) failed: %s", situation.value, exc)
        finally:
            self.held.discard(msg)
            if self.on_settled is not None:
                self.on_settled(base or msg.subject.rsplit(".", 1)[-1], situation.value)

    async def _dead_letter(self, msg: Any, base: str, reason: str, deliveries: int) -> bool:
        headers = {
            HDR_DLQ_REASON: reason.replace("\r", " ").replace("\n", " ")[:1000],
            HDR_DLQ_SUBJECT: msg.subject,
            HDR_DLQ_DELIVERIES: str(deliveries),
        }
        orig_id = (msg.headers or {}).get(HDR_MSG_ID)
        if orig_id:
            headers[HDR_MSG_ID] = f"dlq-{orig_id}"  # idempotent if a retry dead-letters it twice
        try:
            await self.js.publish(dlq_subject(base or msg.subject.rsplit(".", 1)[-1]), msg.data, headers=headers,
                                  stream=self.queue.dlq_stream)
            return True
        except Exception as exc:
            log.error("dead-letter publish failed (task kept for another delivery): %s", exc)
            return False


async def _true() -> bool:
    return True
