"""The pull loop of one base whose runtime is an engine (`runtime.EngineRuntime`, e.g. vLLM).

An engine batches continuously by itself: a sequence joins the running batch at the next step and
leaves it when it finishes. So this lane never waits to fill a batch; it keeps the engine fed up to
its slot target (`runtime.slots`, sequences in flight) and pulls again as sequences finish. Pull
when free still holds, counted in sequences: a task is pulled only when a slot is free for it, so
the tasks a busy worker cannot start stay in the shared queue for its peers. A pull takes at most
the free slots' worth of the backlog at once (one fetch), never waits for more.

Each sequence runs as a task on the worker's event loop: intake (intake.py) → adapter (loaded once
on first use, engine_adapters.py) → `runtime.stream` → chunks (streaming.py) → final result with a
receipt, then ack (settle.py). A client that went away or a passed deadline aborts the sequence in
the engine. A dead engine is restarted once per death while the lane stops pulling; its tasks
in flight go back to the queue (nak) and are retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.batcher import Pulled
from lorafleet.sidecar.engine_adapters import EngineAdapters
from lorafleet.sidecar.intake import Intake
from lorafleet.sidecar.pull import fill, wait_first
from lorafleet.sidecar.runtime import EngineDown, EngineRuntime, EngineStats, Generated, GenerateInput, RequestRefused
from lorafleet.sidecar.service_rate import ServiceRate
from lorafleet.sidecar.settle import Settler, Text, num_delivered
from lorafleet.sidecar.streaming import DEADLINE, TextOut, TextStreams

log = logging.getLogger(__name__)

UriFor = Callable[[str, str | None], str | None]
Verdict = tuple[Situation, str, Text | None]


class EngineLane:
    def __init__(self, base: str, psub: Any, runtime: EngineRuntime, adapters: EngineAdapters, intake: Intake,
                 settler: Settler, streams: TextStreams, uri_for: UriFor, stopping: Callable[[], bool], *,
                 on_pull_error: Callable[[str, BaseException], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.base = base
        self.psub = psub
        self.runtime = runtime
        self.adapters = adapters
        self.intake = intake
        self.settler = settler
        self.streams = streams
        self.uri_for = uri_for
        self.stopping = stopping
        self.on_pull_error = on_pull_error or (lambda base, exc: log.warning("pull on %s failed: %s", base, exc))
        self.on_fatal = on_fatal or (lambda exc: None)
        self.slots = max(int(runtime.slots), 1)
        self.in_use = 0
        self.ready = False  # the engine serves (heartbeats list the base only then)
        self.service_rate = ServiceRate()
        self.stats = EngineStats()
        self._freed = asyncio.Event()
        self._running: set[asyncio.Task[None]] = set()
        self._restart: asyncio.Task[None] | None = None

    # -- pulling ------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Start the engine, then pull while slots are free, until the worker stops."""
        await self.runtime.start()
        self.ready = True
        log.info("engine of %s serves; keeping up to %d sequences in flight", self.base, self.slots)
        while not self.stopping():
            if self._restart is not None:
                await asyncio.shield(self._restart)
                continue
            if self.in_use >= self.slots:
                self._freed.clear()
                await self._freed.wait()
                continue
            try:
                first = await wait_first(self.psub)
            except Exception as exc:  # reconnecting, or the consumer is missing (the keeper re-creates it)
                self.on_pull_error(self.base, exc)
                await asyncio.sleep(0.5)
                continue
            if first is None:
                continue
            self.intake.held.add(first)
            try:  # the backlog, up to the free slots, in one fetch; no wait for more: the engine batches itself
                msgs = await fill(self.psub, [first], self.slots - self.in_use, 0.0)
            except Exception as exc:
                self.on_pull_error(self.base, exc)
                msgs = [first]
            for p in await self.intake.admit(self.base, msgs):
                self._start(p)

    def _start(self, p: Pulled) -> None:
        self.in_use += 1
        task = asyncio.create_task(self._serve(p), name=f"seq-{p.task.id}")
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _free(self) -> None:
        self.in_use -= 1
        self._freed.set()

    async def cancel_all(self) -> None:
        """At a drain timeout: stop every sequence without settling it (the caller gives the tasks back)."""
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)

    # -- one sequence -------------------------------------------------------------------------------
    async def _serve(self, p: Pulled) -> None:
        started = time.time()
        out = self.streams.open(p.task, num_delivered(p.msg), bool(p.params and p.params.stream))
        self.service_rate.begin()
        verdict: Verdict | None = None
        try:
            verdict = await self._generate(p, out)
        finally:
            self.streams.close(out)
            self._free()
            self.service_rate.end(1 if verdict is not None and verdict[0] is Situation.OK else 0)
        situation, reason, text = verdict
        if text is not None:
            text.chunks = out.seq
        await self.settler.settle(p.msg, self.base, situation, task=p.task, reason=reason, vector=text,
                                  started=started, batch_size=self.in_use + 1)

    async def _generate(self, p: Pulled, out: TextOut) -> Verdict:
        task, adapter = p.task, p.task.adapter
        epoch = 0
        if adapter is not None:
            try:
                epoch = await self.adapters.acquire(adapter, self.uri_for(adapter, task.adapter_uri))
            except AdapterUnavailable as exc:
                log.warning("adapter %s unavailable: %s", adapter, exc)
                return Situation.ADAPTER_UNAVAILABLE, str(exc), None
            except EngineDown as exc:
                self._engine_down(exc)
                return Situation.RUNTIME_FAILED, f"engine down: {exc}", None
            except Exception as exc:
                log.warning("adapter %s failed to load (will retry): %s", adapter, exc)
                return Situation.ADAPTER_FAILED, f"{type(exc).__name__}: {exc}", None
        try:
            return await self._stream(p, out)
        finally:
            if adapter is not None:
                self.adapters.release(adapter, epoch)  # ignored when the engine restarted meanwhile

    async def _stream(self, p: Pulled, out: TextOut) -> Verdict:
        assert p.params is not None
        item = GenerateInput(p.task.text, p.params, p.task.id)
        consume = asyncio.ensure_future(self._consume(item, p.task.adapter, out))
        out.on_abort(lambda reason: consume.cancel())
        if out.aborted:  # the check may have answered before the callback was in place
            consume.cancel()
        try:
            generated = await consume
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if out.reason is None or (current is not None and current.cancelling()):
                raise  # the worker is shutting down, not this sequence
            if out.reason == DEADLINE:
                return Situation.DEADLINE, "deadline passed while generating", None
            return Situation.CANCELLED, "nobody waits for the text any more", None
        except RequestRefused as exc:
            return Situation.INVALID, str(exc), None
        except EngineDown as exc:
            self._engine_down(exc)
            return Situation.RUNTIME_FAILED, f"engine down: {exc}", None
        except Exception as exc:
            log.warning("generation of %s failed (will retry): %r", p.task.id, exc)
            return Situation.RUNTIME_FAILED, f"{type(exc).__name__}: {exc}", None
        return Situation.OK, "", Text(generated)

    async def _consume(self, item: GenerateInput, adapter: str | None, out: TextOut) -> Generated:
        async with contextlib.aclosing(self.runtime.stream(item, adapter)) as items:
            async for piece in items:
                if isinstance(piece, Generated):
                    return piece
                await out.delta(piece)
        raise RuntimeError("the engine's stream ended without a finished sequence")

    # -- a dead engine --------------------------------------------------------------------------------
    def _engine_down(self, exc: BaseException) -> None:
        if self._restart is None and not self.stopping():
            log.error("engine of %s is down (%s); restarting it", self.base, exc)
            self.ready = False
            self._restart = asyncio.ensure_future(self._restart_engine())

    async def _restart_engine(self) -> None:
        try:
            await self.runtime.restart()
        except Exception as exc:
            log.error("engine of %s did not come back: %s", self.base, exc)
            self.on_fatal(exc)
            return
        finally:
            self._restart = None
        self.adapters.reset()
        self.ready = True
        log.info("engine of %s serves again", self.base)

    async def read_stats(self) -> EngineStats:
        """The engine's own figures, for heartbeats; the last known ones when it does not answer."""
        if self.ready:
            with contextlib.suppress(Exception):
                self.stats = await asyncio.wait_for(self.runtime.stats(), 0.5)
        return self.stats
