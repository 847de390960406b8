"""Publishing a task to the work stream, through a NATS failover, and what a failed publish tells the client.

A publish waits for JetStream's ack (not for the deadline: a 1 ms deadline still publishes). Through a
failover (a node lost: JetStream re-elects the stream's leader in 4-9 s) it is retried for at most
PUBLISH_RETRY_S, never past the request's deadline, with the same Nats-Msg-Id: an attempt that was stored
but whose ack was lost is not stored twice (the stream's duplicate window).

A request of several tasks fails whole: when one publish fails for good, `take_back` deletes the others
from the stream (by the sequence numbers of their acks) before a worker computes them for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.errors import ConnectionReconnectingError, OutboundBufferLimitError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from lorafleet.core import wire
from lorafleet.nats.queue import JS_ERR_STREAM_FULL
from lorafleet.serve.errors import ApiError
from lorafleet.serve.pending import TIMEOUT, PendingRequest

log = logging.getLogger("lorafleet.serve")

PUBLISH_TIMEOUT_S = 2.0  # one attempt's wait for the ack
PUBLISH_RETRY_S = 20.0
# What a failover looks like to a publisher: no ack in time, no responder (no stream leader yet), JetStream
# "temporarily unavailable", the connection being re-established.
_TRANSIENT = (asyncio.TimeoutError, NatsTimeoutError, NoStreamResponseError, ServiceUnavailableError,
              ConnectionReconnectingError, OutboundBufferLimitError)


async def publish_task(js: JetStreamContext, subject: str, payload: bytes, task_id: str, pending: PendingRequest,
                       deadline_s: float, on_no_stream: Callable[[], None]) -> PubAck:
    """Publish one task, retrying through a failover with the same Nats-Msg-Id; `on_no_stream` when no stream
    answers (no leader yet, or the stream is gone: the queue monitor re-creates a lost one)."""
    headers = {wire.HDR_MSG_ID: task_id}
    give_up = time.monotonic() + min(PUBLISH_RETRY_S, deadline_s)
    delay = 0.05
    while True:
        try:
            return await js.publish(subject, payload, timeout=PUBLISH_TIMEOUT_S, headers=headers)
        except _TRANSIENT as exc:
            full = isinstance(exc, APIError) and exc.err_code in JS_ERR_STREAM_FULL  # a 503 too: answer 429 now
            if full or pending.future.done() or time.monotonic() + delay >= give_up:
                raise
            if isinstance(exc, NoStreamResponseError):
                on_no_stream()
            log.debug("publish of task %s retried after %r", task_id, exc)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)


async def take_back(js: JetStreamContext, acks: list[PubAck]) -> None:
    """Delete the published tasks of a request that failed. Best effort, bounded in time: a task a worker
    already pulled is computed anyway (its result finds no pending request and is dropped)."""
    if not acks:
        return
    try:
        done = await asyncio.wait_for(asyncio.gather(*(js.delete_msg(a.stream, a.seq) for a in acks),
                                                     return_exceptions=True), PUBLISH_TIMEOUT_S)
    except (TimeoutError, NatsTimeoutError):
        done = []
    kept = len(acks) - sum(1 for d in done if d is True)
    if kept:
        log.warning("%d of %d published tasks of a failed request could not be taken back", kept, len(acks))


def deadline_error(deadline_s: float, filled: int, n: int) -> ApiError:
    return ApiError(
        504, "deadline_exceeded",
        f"the deadline of {deadline_s * 1000:.0f} ms passed with {filled} of {n} inputs embedded; "
        "send a longer X-Lorafleet-Deadline-Ms (or deadline_ms) or retry when the queue is shorter",
    )


def publish_error(exc: BaseException, deadline_s: float, pending: PendingRequest, stream: str,
                  retry_after: dict[str, str], on_no_stream: Callable[[], None]) -> ApiError:
    """The client's answer to a publish that failed for good."""
    if pending.future.done() and pending.future.result() is TIMEOUT:
        # The deadline passed while publishing (a 1 ms deadline): that, not the publish, is the answer.
        return deadline_error(deadline_s, pending.filled, pending.n)
    if isinstance(exc, APIError) and exc.err_code in JS_ERR_STREAM_FULL:
        return ApiError(429, "queue_full", f"the work queue is full ({exc.description}); retry later", retry_after)
    if isinstance(exc, NoStreamResponseError):
        on_no_stream()  # the stream is gone: re-create it now, not at the next read
        return ApiError(503, "queue_unavailable", f"the work stream {stream} does not answer; retry shortly",
                        retry_after)
    if isinstance(exc, asyncio.TimeoutError | NatsTimeoutError):
        return ApiError(503, "queue_unavailable", "the work stream did not acknowledge in time; retry shortly",
                        retry_after)
    log.warning("publish failed: %r", exc)  # the details stay in the log, not in the client's answer
    return ApiError(503, "queue_unavailable", "publishing to the work queue failed; retry shortly", retry_after)
