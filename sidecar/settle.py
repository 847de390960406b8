"""Settling: every task leaves a worker through here — its reply goes to the gateway, its message is settled.

One reply path for every result, success or error: a reply is sent as a core-NATS request to the
task's reply inbox and counts only once the gateway confirms it with a receipt. Core NATS drops a
message nobody is subscribed to, so a gateway that is reconnecting (or a server that just
restarted) would otherwise never see an answer whose task we then ack or terminate. An
unconfirmed reply keeps the task for another delivery (nak with delay) unless nobody waits for
it any more (its deadline passed) or this is its last delivery. Duplicates this can cause are
dropped by the gateway. The table of what to do in each situation is `acks.ACK_TABLE`.

The class talks to NATS only through the message (`ack`, `nak`, `term`, `data`, `metadata`,
`headers`, `subject`) and the connection (`request`) and JetStream (`publish`) objects it is
given, so its logic is unit-tested with small fakes, without a worker process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nats.errors import NoRespondersError

from lorafleet.config import QueueConfig
from lorafleet.sidecar.acks import REPLY_RESULT, Action, Settle, Situation, decide, is_last_delivery
from lorafleet.sidecar.batcher import Batch
from lorafleet.sidecar.runtime import Generated
from lorafleet.wire import (
    HDR_DLQ_DELIVERIES,
    HDR_DLQ_REASON,
    HDR_DLQ_SUBJECT,
    HDR_MSG_ID,
    Result,
    Task,
    dlq_subject,
    unpack,
)

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


Payload = bytes | Text  # an embedding (float32 bytes) or a generated text


@dataclass(slots=True)
class Outcome:
    """What the main thread made of one task of a batch."""

    situation: Situation
    vector: bytes | None = None
    message: str = ""
    text: Text | None = None

    @property
    def payload(self) -> Payload | None:
        return self.vector if self.vector is not None else self.text


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
        n = len(batch.items)
        await self.settle_many([
            (item.msg, batch.base, out.situation, item.task, out.message, out.payload, started)
            for item, out in zip(batch.items, outcomes, strict=True)
        ], batch_size=n)

    async def settle_many(self, items: Sequence[tuple[Any, str, Situation, Task | None, str, Payload | None, float]],
                          batch_size: int = 0) -> None:
        """Settle several tasks, their replies delivered concurrently (one slow gateway does not serialise them).

        Each item: (msg, base, situation, task or None, reason, vector or Text or None, compute start time).
        """
        plans = [self._plan(*item, batch_size=batch_size) for item in items]
        delivered = await asyncio.gather(*(self._deliver(reply, body) if body is not None else _true()
                                           for _, _, _, reply, body in plans))
        for (msg, base, situation, _, _), done, item in zip(plans, delivered, items, strict=True):
            await self._finish(msg, base, situation, item[3], item[4], done)

    async def settle(self, msg: Any, base: str, situation: Situation, *, task: Task | None = None,
                     reason: str = "", vector: Payload | None = None, started: float | None = None,
                     batch_size: int = 0) -> None:
        await self.settle_many([(msg, base, situation, task, reason, vector,
                                 time.time() if started is None else started)], batch_size=batch_size)

    # -- steps -------------------------------------------------------------------------------------
    def _plan(self, msg: Any, base: str, situation: Situation, task: Task | None, reason: str,
              payload: Payload | None, started: float, batch_size: int = 0
              ) -> tuple[Any, str, Situation, str | None, bytes | None]:
        """(msg, base, situation, reply inbox, reply body): what to send before settling."""
        action = decide(situation, num_delivered(msg), self.queue.max_deliver)
        if action.reply is None:
            return msg, base, situation, None, None
        target = (task.reply, task.id, task.index) if task else reply_hint(msg.data)
        if target is None:  # not even a reply inbox could be read: nobody to tell
            return msg, base, situation, None, None
        reply, task_id, index = target
        if action.reply == REPLY_RESULT:
            queue_ms = max(started - task.enqueued, 0.0) * 1000.0 if task else 0.0
            if isinstance(payload, Text):
                g = payload.generated
                result = Result(task_id, index, self.worker_id, text=g.text, prompt_tokens=g.prompt_tokens,
                                completion_tokens=g.completion_tokens, finish_reason=g.finish_reason,
                                queue_ms=queue_ms, batch_size=batch_size, seq=payload.chunks,
                                attempt=num_delivered(msg))
            else:
                result = Result(task_id, index, self.worker_id, vector=payload, dim=self.dims.get(base, 0),
                                queue_ms=queue_ms, batch_size=batch_size)
        else:
            result = Result(task_id, index, self.worker_id, error_code=action.reply,
                            error_message=reason or situation.value, batch_size=batch_size)
        return msg, base, situation, reply, result.to_wire()

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

    async def _finish(self, msg: Any, base: str, situation: Situation, task: Task | None, reason: str,
                      delivered: bool) -> None:
        deliveries = num_delivered(msg)
        action = decide(situation, deliveries, self.queue.max_deliver)
        action, why = after_reply(action, situation, delivered, is_last_delivery(deliveries, self.queue.max_deliver))
        if why:
            situation, reason = Situation.UNDELIVERED, f"{why} ({situation.value}{': ' + reason if reason else ''})"
        try:
            settle = action.settle
            if action.dead_letter and not await self._dead_letter(msg, base, reason or situation.value, deliveries):
                settle = Settle.NAK  # keep the task rather than lose it; the next delivery tries again
            if settle is Settle.ACK:
                await msg.ack()
            elif settle is Settle.TERM:
                await msg.term()
            else:
                await msg.nak(delay=self.queue.nak_delay_s if action.nak_delay else None)
            if settle is not Settle.NAK:
                self.tasks_done += 1
            if situation is not Situation.OK:
                log.log(_LOG_LEVEL.get(situation, logging.WARNING),
                        "task %s: %s → %s%s (delivery %d/%d)%s", task.id if task else "?", situation.value,
                        settle.value, " + dead-letter" if action.dead_letter else "", deliveries,
                        self.queue.max_deliver, f": {reason}" if reason else "")
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
