"""The worker's NATS side: an asyncio loop in a background thread that owns the connection.

It connects, sets up the streams and this worker's consumers, runs the pull scheduler
(scheduler.py), hands batches to the main thread (which runs the model) through a queue bounded by
the scheduler's slots, settles each task when the main thread posts the outcome back
(settle.py), keeps held messages alive (in_progress), publishes heartbeats and watches the fleet
state. Per-task work here is kept small: decode, reply, ack. The main thread talks to it only
through the thread-safe methods at the top of `NatsSide`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import nats

from lorafleet.config import FleetConfig
from lorafleet.fleet_state import FleetWatcher
from lorafleet.queue import consumer_config, ensure_consumer, ensure_streams
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.batcher import Batch, ProfileFor
from lorafleet.sidecar.pull import IDLE_POLL_S
from lorafleet.sidecar.scheduler import PullScheduler
from lorafleet.sidecar.settle import HeldTable, Outcome, Settler
from lorafleet.wire import Heartbeat, consumer_name, heartbeat_subject

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0  # initial connect; once connected, reconnects go on for ever


class NatsSide:
    """Owns the NATS connection and everything async; the main thread talks to it via thread-safe calls."""

    def __init__(self, fleet: FleetConfig, nats_url: str, worker_id: str, bases: list[str],
                 profile_for: ProfileFor) -> None:
        self.fleet = fleet
        self.nats_url = nats_url
        self.worker_id = worker_id
        self.bases = bases
        self.profile_for = profile_for
        self.ready: queue.Queue[Batch | None] = queue.Queue()  # bounded by the scheduler's slots
        self.connected = threading.Event()
        self.error: BaseException | None = None
        self.adapters_snapshot: dict[str, list[str]] = {b: [] for b in bases}  # replaced whole by the main thread
        self.dims: dict[str, int] = {}
        self.thread = threading.Thread(target=self._thread_main, name="nats-loop", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.held = HeldTable()
        self.stop_requested = False
        self.batches_done = 0
        self.on_fleet_state: Callable[[dict[str, Any]], None] | None = None  # set by the worker
        self._stopping = False
        self._pull_task: asyncio.Task[None] | None = None
        self._scheduler: PullScheduler | None = None
        self._settler: Settler | None = None
        self._psubs: dict[str, Any] = {}
        self._fleet_watch: FleetWatcher | None = None
        ack_wait = consumer_config(bases[0], fleet.queue).ack_wait or fleet.queue.ack_wait_s
        self._progress_every = max(ack_wait / 3.0, 0.05)  # well below ack_wait, so nothing is redelivered

    @property
    def tasks_done(self) -> int:
        return self._settler.tasks_done if self._settler is not None else 0

    # ---- called from the main thread -------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def wait_connected(self) -> bool:
        while not self.connected.wait(0.2):
            if not self.thread.is_alive():
                return False
        return self.error is None

    def _post(self, fn: Callable[..., Any], *args: Any) -> bool:
        loop = self.loop
        if loop is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed between the check and the call
            return False
        return True

    def start_serving(self, dims: dict[str, int]) -> None:
        self.dims.update(dims)
        self._post(self._models_ready.set)

    def request_stop(self) -> None:
        self.stop_requested = True  # seen by _main even if the loop does not exist yet
        self._post(self._begin_stop)

    def complete(self, batch: Batch, outcomes: Sequence[Outcome], started: float,
                 encoded: tuple[int, float] | None = None) -> None:
        """Post a computed batch back; `encoded` is (items, seconds) of its compute, when it ran whole."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._complete(batch, outcomes, started, encoded), loop)
        except RuntimeError:
            log.warning("loop closed; results of a batch of %d dropped (the tasks were given back)", len(batch))

    # ---- the loop thread ----------------------------------------------------------------------
    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self.error = exc
            if not (isinstance(exc, ConnectionError) and self._stopping):
                log.error("NATS side failed: %s", exc, exc_info=not isinstance(exc, OSError))
        finally:
            self.connected.set()
            self.ready.put(None)  # tells the main thread to finish

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(self.fleet.worker.profile.batches_in_flight + 1)
        self._models_ready = asyncio.Event()
        self._stop = asyncio.Event()
        if self.stop_requested:
            self._begin_stop()
        self.nc = await self._connect()
        self.js = self.nc.jetstream()
        await ensure_streams(self.js, self.fleet.queue)
        for base in self.bases:
            await ensure_consumer(self.js, base, self.fleet.queue)
        self._settler = Settler(self.nc, self.js, self.fleet.queue, self.worker_id, self.held, self.dims)
        log.info("connected to %s; consumers ready for %s", self.nats_url, ", ".join(self.bases))
        if self.on_fleet_state is not None:  # promoted bundles: URIs and profiles per adapter id
            try:
                self._fleet_watch = FleetWatcher(self.js, self.on_fleet_state)
                await self._fleet_watch.start()
            except Exception as exc:
                log.warning("cannot watch the fleet state bucket: %r; using the fleet file only", exc)
        self.connected.set()
        waiters = [asyncio.ensure_future(self._models_ready.wait()), asyncio.ensure_future(self._stop.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        background: list[asyncio.Task[None]] = []
        served = not self._stop.is_set()
        if served:
            for base in self.bases:
                self._psubs[base] = await self.js.pull_subscribe_bind(
                    durable=consumer_name(base), stream=self.fleet.queue.stream
                )
            self._scheduler = PullScheduler(self.fleet, self._psubs, self.held, self._settler, self.ready.put_nowait,
                                            self.profile_for, self._slots, lambda: self._stopping)
            await self._publish_heartbeat(0.0)  # the launcher waits for this one to call the worker ready
            log.info("serving %s", ", ".join(self.bases))
            background = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._progress_loop())]
            self._pull_task = asyncio.create_task(self._scheduler.run())
            await self._stop.wait()
            await self._drain()
        for t in background:
            t.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if served:
            await self._publish_heartbeat(0.0)  # last word: draining=True, in_flight 0
        if self._fleet_watch is not None:
            await self._fleet_watch.stop()
        for psub in self._psubs.values():
            try:
                await psub.unsubscribe()  # before drain(), which otherwise hangs on pull subscriptions
            except Exception as exc:
                log.debug("unsubscribe: %s", exc)
        await self.nc.drain()

    async def _connect(self) -> Any:
        """Connect, giving up after CONNECT_TIMEOUT_S or as soon as a stop is requested."""
        connect = asyncio.ensure_future(nats.connect(
            self.nats_url, name=f"lorafleet-worker-{self.worker_id}", max_reconnect_attempts=-1,
            error_cb=self._on_error, disconnected_cb=self._on_disconnect, reconnected_cb=self._on_reconnect,
        ))
        stop = asyncio.ensure_future(self._stop.wait())
        done, _ = await asyncio.wait([connect, stop], timeout=CONNECT_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if connect in done:
            return connect.result()
        connect.cancel()
        await asyncio.gather(connect, return_exceptions=True)
        why = "stop requested" if stop in done else f"no answer within {CONNECT_TIMEOUT_S:.0f}s"
        raise ConnectionError(f"cannot connect to NATS at {self.nats_url} ({why}); is nats-server running there?")

    async def _on_error(self, exc: Exception) -> None:
        log.warning("NATS error: %s", exc)

    async def _on_disconnect(self) -> None:
        # drain() at shutdown disconnects on purpose; only an unplanned loss is worth a warning.
        log.log(logging.INFO if self._stopping else logging.WARNING, "disconnected from NATS")

    async def _on_reconnect(self) -> None:
        log.info("reconnected to NATS")

    def _begin_stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        log.info("stopping: no new pulls; finishing %d in-flight task(s)", len(self.held))
        scheduler = self._scheduler
        if self._pull_task is not None and scheduler is not None and scheduler.phase == "slot":
            self._pull_task.cancel()  # waiting for a free slot, holding nothing
        self._stop.set()

    async def _drain(self) -> None:
        assert self._scheduler is not None and self._settler is not None
        if self._pull_task is not None:
            await asyncio.wait([self._pull_task], timeout=IDLE_POLL_S + 2.0)
        await self._scheduler.give_back_waiting()
        timeout = self.fleet.worker.drain_timeout_s
        if await self.held.wait_empty(timeout):
            log.info("drained: all in-flight tasks answered")
            return
        log.warning("drain timed out after %.1fs; giving back %d task(s)", timeout, len(self.held))
        while True:
            try:
                self.ready.get_nowait()
            except queue.Empty:
                break
        await self._settler.settle_many([(h.msg, "", Situation.SHUTDOWN, None,
                                          "worker shut down before computing the task", None, time.time())
                                         for h in self.held.values()])

    async def _complete(self, batch: Batch, outcomes: Sequence[Outcome], started: float,
                        encoded: tuple[int, float] | None) -> None:
        self._slots.release()
        if encoded is not None and self._scheduler is not None and batch.base in self._scheduler.batch_times:
            self._scheduler.batch_times[batch.base].observe(*encoded)
        assert self._settler is not None
        await self._settler.complete(batch, outcomes, started)
        self.batches_done += 1

    # ---- keep-alives --------------------------------------------------------------------------
    async def _progress_loop(self) -> None:
        every = self._progress_every
        while True:
            await asyncio.sleep(every / 2)
            now = time.monotonic()
            for held in self.held.values():
                if now - held.last_progress >= every:
                    held.last_progress = now
                    try:
                        await held.msg.in_progress()
                    except Exception as exc:
                        log.debug("in_progress failed: %s", exc)

    async def _heartbeat_loop(self) -> None:
        every = self.fleet.worker.heartbeat_s
        last_t, last_batches = time.monotonic(), self.batches_done
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            rate = (self.batches_done - last_batches) / max(now - last_t, 1e-6)
            last_t, last_batches = now, self.batches_done
            await self._publish_heartbeat(rate)

    async def _publish_heartbeat(self, batches_per_s: float) -> None:
        hb = Heartbeat(
            worker=self.worker_id, bases=list(self.bases), adapters=dict(self.adapters_snapshot),
            in_flight=len(self.held), batches_per_s=round(batches_per_s, 3), tasks_done=self.tasks_done,
            pid=os.getpid(), host=socket.gethostname(), draining=self._stopping,
        )
        try:
            await self.nc.publish(heartbeat_subject(self.worker_id), hb.to_wire())
        except Exception as exc:
            log.debug("heartbeat publish failed: %s", exc)
