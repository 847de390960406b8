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
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from nats.errors import NoRespondersError

from lorafleet.wire import RECEIPT_CANCEL, Result, Task

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
            self._streams.check(self, body)
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


class TextStreams:
    """The generating tasks of one worker connection (event loop only, but `aborted` may be read anywhere)."""

    def __init__(self, nc: Any, worker_id: str) -> None:
        self.nc = nc
        self.worker_id = worker_id
        self._open: dict[str, TextOut] = {}
        self._checks: set[asyncio.Task[None]] = set()

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

    def check(self, out: TextOut, body: bytes = b"") -> None:
        """Ask the task's gateway (in the background) whether anyone still waits; abort the task if not."""
        task = asyncio.ensure_future(self._check(out, body))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _check(self, out: TextOut, body: bytes) -> None:
        try:
            receipt = await self.nc.request(out.task.reply, body, timeout=CHECK_TIMEOUT_S)
        except NoRespondersError:
            out.abort(CANCELLED)  # nobody listens on the inbox: its gateway is gone
            return
        except Exception as exc:  # a timeout or a reconnect says nothing about the client
            log.debug("check of %s inconclusive: %r", out.task.id, exc)
            return
        if receipt.data == RECEIPT_CANCEL:
            out.abort(CANCELLED)

    async def watch(self) -> None:
        """Runs for the connection's life: probes tasks that sent nothing lately, aborts those past deadline."""
        while True:
            await asyncio.sleep(CHECK_S / 2)
            now, wall = time.monotonic(), time.time()
            for out in list(self._open.values()):
                if out.reason is not None:
                    continue
                if out.task.deadline <= wall:
                    out.abort(DEADLINE)
                elif now - out.last_check >= CHECK_S:
                    out.last_check = now
                    self.check(out)
