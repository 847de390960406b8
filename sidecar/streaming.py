"""Text on its way back while it is generated, and the gateway's word on whether anyone still wants it.

A generate task that asks to stream is answered in numbered chunks (`Result.seq`, core-NATS
publishes to the task's reply inbox, in order) before its final result (settle.py). Every chunk
also carries the task's delivery number (`Result.attempt`), so a gateway can tell the chunks of a
redelivery from those of a worker that died mid-stream.

Cancellation: a gateway answers every request on its inbox with a receipt that says whether the
request is still pending (`wire.RECEIPT_CANCEL` once its client is gone or its deadline passed). So
at most every `CHECK_S` a generating task asks: a chunk goes as a request instead of a plain
publish, and a task with nothing to send (not streaming, or waiting in the engine's queue) sends an
empty probe. "Nobody waits" or "nobody listens" (no responders: the gateway is gone) aborts the
generation in the runtime; a passed deadline does too. Per-chunk cost stays a plain publish.

Order on the wire is the sender's: a task's chunks are published by one coroutine at a time, each
before the next (an engine lane's sequence awaits `delta`; the main thread's deltas queue for one
writer). A check-in chunk is published right there too, with a reply subject (`Receipts`); only the
wait for its receipt runs apart, after the publish, so no later chunk can overtake it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from lorafleet.core.deadlines import local_deadline
from lorafleet.core.wire import RECEIPT_CANCEL, Result, Task

log = logging.getLogger(__name__)

CHECK_S = 0.2  # how often a generating task asks whether anyone still waits for it
CHECK_TIMEOUT_S = 2.0
CANCELLED = "cancelled"
DEADLINE = "deadline"


class TextOut:
    """One generating task on the worker's event loop: its chunks, and why it must stop (if it must)."""

    __slots__ = ("_backlog", "_on_abort", "_streams", "_writer", "attempt", "last_check", "reason", "seq", "stream",
                 "task")

    def __init__(self, streams: TextStreams, task: Task, attempt: int, stream: bool) -> None:
        self._streams = streams
        self.task = task
        self.attempt = attempt
        self.stream = stream
        self.seq = 0  # chunks sent
        self.last_check = time.monotonic()
        self.reason: str | None = None  # CANCELLED or DEADLINE once it must stop
        self._on_abort: list[Callable[[str], None]] = []
        self._backlog: collections.deque[str] = collections.deque()
        self._writer: asyncio.Task[None] | None = None

    @property
    def aborted(self) -> bool:
        return self.reason is not None

    def on_abort(self, callback: Callable[[str], None]) -> None:
        self._on_abort.append(callback)

    def abort(self, reason: str) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        for callback in self._on_abort:
            callback(reason)

    async def delta(self, text: str) -> None:
        """Send the next chunk (when the task streams); every CHECK_S one goes as a request that checks in."""
        if not self.stream or not text or self.reason is not None:
            return
        body = Result(self.task.id, self.task.index, self._streams.worker_id, text=text, seq=self.seq,
                      attempt=self.attempt).to_wire()
        self.seq += 1
        now = time.monotonic()
        if now - self.last_check >= CHECK_S:
            self.last_check = now
            await self._streams.check_in(self, body)  # published now, in order; the receipt is awaited apart
            return
        try:
            await self._streams.nc.publish(self.task.reply, body)
        except Exception as exc:  # reconnecting: the final result (with the whole text) still goes with a receipt
            log.debug("chunk %d of %s not sent: %r", self.seq - 1, self.task.id, exc)

    def post(self, text: str) -> None:
        """`delta` from a plain callback on the loop (text from the main thread): queued, sent in order."""
        if not self.stream or self.reason is not None:
            return
        self._backlog.append(text)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        while self._backlog:
            text = "".join(self._backlog)  # what piled up while a publish was awaited goes as one chunk
            self._backlog.clear()
            await self.delta(text)

    async def flushed(self) -> int:
        """Once every posted chunk went out: the number of chunks sent."""
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await self._writer
        return self.seq


class Receipts:
    """Requests whose publish happens in line with the caller's other publishes; their answers come apart.

    `nc.request` publishes from a task of its own, so a message published after it may reach the
    wire first. Here the caller publishes (with a reply subject under one wildcard subscription of
    this connection, like nats-py's own request inbox) and gets the answer's future back.
    """

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self._prefix: str | None = None
        self._subscribing = asyncio.Lock()
        self._waiting: dict[str, asyncio.Future[Any]] = {}
        self._next = 0

    async def send(self, subject: str, body: bytes) -> tuple[str, asyncio.Future[Any]]:
        """Publish `body` to `subject` asking for an answer: (token, future of the answer)."""
        prefix = self._prefix or await self._subscribe()
        self._next += 1
        token = str(self._next)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[token] = future
        try:
            await self.nc.publish(subject, body, reply=prefix + token)
        except BaseException:
            self._waiting.pop(token, None)
            raise
        return token, future

    def forget(self, token: str) -> None:
        self._waiting.pop(token, None)

    async def _subscribe(self) -> str:
        async with self._subscribing:
            if self._prefix is None:
                prefix = self.nc.new_inbox() + "."  # under this client's inbox prefix: its own to subscribe to
                await self.nc.subscribe(prefix + "*", cb=self._on_answer)
                self._prefix = prefix
            return self._prefix

    async def _on_answer(self, msg: Any) -> None:
        assert self._prefix is not None
        future = self._waiting.pop(msg.subject[len(self._prefix):], None)
        if future is not None and not future.done():
            future.set_result(msg)


def _no_responders(msg: Any) -> bool:
    """The server's answer when nobody subscribes to the subject (status 503)."""
    return bool(msg.headers) and msg.headers.get("Status") == "503"


class TextStreams:
    """The generating tasks of one worker connection (event loop only, but `aborted` may be read anywhere)."""

    def __init__(self, nc: Any, worker_id: str) -> None:
        self.nc = nc
        self.worker_id = worker_id
        self._open: dict[str, TextOut] = {}
        self._checks: set[asyncio.Task[None]] = set()  # receipts awaited: kept until they end
        self.receipts = Receipts(nc)

    def __len__(self) -> int:
        return len(self._open)

    def open(self, task: Task, attempt: int, stream: bool) -> TextOut:
        out = TextOut(self, task, attempt, stream)
        self._open[task.id] = out
        return out

    def get(self, task_id: str) -> TextOut | None:
        return self._open.get(task_id)

    def close(self, out: TextOut) -> None:
        if self._open.get(out.task.id) is out:
            del self._open[out.task.id]

    async def check_in(self, out: TextOut, body: bytes = b"") -> None:
        """Send `body` (a chunk, or an empty probe) asking whether anyone still waits; abort the task if not.

        The publish happens before this returns, so the caller's next chunk follows it on the wire; the
        receipt is awaited by a task of its own (kept in `_checks`).
        """
        try:
            token, receipt = await self.receipts.send(out.task.reply, body)
        except Exception as exc:  # reconnecting: the final result (with the whole text) still goes with a receipt
            log.debug("check-in of %s not sent: %r", out.task.id, exc)
            return
        task = asyncio.ensure_future(self._await_receipt(out, token, receipt))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _await_receipt(self, out: TextOut, token: str, receipt: asyncio.Future[Any]) -> None:
        try:
            msg = await asyncio.wait_for(receipt, CHECK_TIMEOUT_S)
        except TimeoutError:  # a slow or reconnecting gateway says nothing about the client
            log.debug("check of %s inconclusive: no receipt", out.task.id)
            return
        finally:
            self.receipts.forget(token)
        if _no_responders(msg) or msg.data == RECEIPT_CANCEL:
            out.abort(CANCELLED)  # nobody listens on the inbox (its gateway is gone), or nobody waits

    async def watch(self) -> None:
        """Runs for the connection's life: probes tasks that sent nothing lately, aborts those past deadline."""
        while True:
            await asyncio.sleep(CHECK_S / 2)
            now, wall = time.monotonic(), time.time()
            for out in list(self._open.values()):
                if out.reason is not None:
                    continue
                if local_deadline(out.task) <= wall:
                    out.abort(DEADLINE)
                elif now - out.last_check >= CHECK_S:
                    out.last_check = now
                    await self.check_in(out)
