"""The worker's NATS side: an asyncio loop in a background thread that owns the connection.

It connects (with this worker's credential: `nats_client.ClientSettings`), waits for the work stream
and keeps this worker's consumers in place (consumers.py: re-created when they vanish), runs the pull scheduler
of the batch runtimes' bases (scheduler.py), hands batches to the main thread (which runs the model)
through a queue bounded by the scheduler's slots, settles each task when the main thread posts the
outcome back (settle.py), keeps held messages alive (in_progress), publishes heartbeats and watches the
fleet state. Bases whose runtime is an engine get a lane of their own on this loop (engine_lane.py),
which also starts and stops their engines: the engine processes are tied to this thread. Generated
text is streamed back from here (streaming.py). Per-task work here is kept small: decode, reply, ack."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import nats

from lorafleet.core.config import FleetConfig
from lorafleet.core.fleet_state import FleetEntry, FleetWatcher
from lorafleet.core.heartbeats import Beacon
from lorafleet.core.wire import GENERATE, Heartbeat, consumer_name, heartbeat_subject
from lorafleet.nats.auth import explain_connect_error
from lorafleet.nats.client import RECONNECT_OPTIONS, server_urls
from lorafleet.nats.queue import consumer_config
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.batcher import Batch, ProfileFor
from lorafleet.sidecar.consumers import ConsumerKeeper
from lorafleet.sidecar.engine_adapters import EngineAdapters
from lorafleet.sidecar.engine_lane import UriFor
from lorafleet.sidecar.engines import EngineLanes
from lorafleet.sidecar.intake import Intake
from lorafleet.sidecar.keepalive import ComputeWatch, KeepAlive, default_stuck_after
from lorafleet.sidecar.owners import OwnerTracker
from lorafleet.sidecar.preload import preload_engine
from lorafleet.sidecar.pull import IDLE_POLL_S
from lorafleet.sidecar.runtime import EngineRuntime
from lorafleet.sidecar.scheduler import PullScheduler
from lorafleet.sidecar.settle import HeldTable, Outcome, Settlement, Settler, num_delivered
from lorafleet.sidecar.streaming import TextStreams

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0  # initial connect; once connected, reconnects go on for ever


class NatsSide:
    """Owns the NATS connection and everything async; the main thread talks to it via thread-safe calls."""

    def __init__(self, fleet: FleetConfig, nats_url: str, worker_id: str, bases: list[str],
                 profile_for: ProfileFor, client_options: dict[str, Any] | None = None) -> None:
        self.fleet = fleet
        self.nats_url = nats_url
        self.client_options = client_options or {}  # credential, private inbox, TLS (never a secret)
        self.worker_id = worker_id
        self.bases = bases
        self.profile_for = profile_for
        self.ready: queue.Queue[Batch | None] = queue.Queue()  # bounded by the scheduler's slots
        self.connected = threading.Event()
        self.error: BaseException | None = None
        self.adapters_snapshot: dict[str, list[str]] = {b: [] for b in bases}  # replaced whole by the main thread
        self.precisions: dict[str, str] = {}  # base → precision served; set by the main thread once bases load
        self.dims: dict[str, int] = {}
        self.thread = threading.Thread(target=self._thread_main, name="nats-loop", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.held = HeldTable()
        self.stop_requested = False
        self.batches_done = 0
        self.on_fleet_state: Callable[[dict[str, Any]], None] | None = None  # set by the worker
        self.on_preload: Callable[[FleetEntry], None] | None = None  # a promotion's staged entry (sidecar/preload.py)
        self._preloads: set[asyncio.Task[None]] = set()
        self.on_settled: Callable[[str, str], None] | None = None  # (base, outcome) per task: the worker's metrics
        self.mixed_bases: frozenset[str] = frozenset()
        self._stopping = False
        self._last_error: BaseException | None = None
        self._last_error_logged = 0.0
        self._pull_task: asyncio.Task[None] | None = None
        self._scheduler: PullScheduler | None = None
        self._settler: Settler | None = None
        self._psubs: dict[str, Any] = {}
        self._keeper: ConsumerKeeper | None = None
        self.owners: OwnerTracker | None = None
        self._fleet_watch: FleetWatcher | None = None
        self.engines = EngineLanes()
        self.streams: TextStreams | None = None
        ack_wait = consumer_config(bases[0], fleet.queue).ack_wait or fleet.queue.ack_wait_s
        self._progress_every = max(ack_wait / 3.0, 0.05)  # well below ack_wait, so nothing is redelivered
        # Held tasks are kept alive within bounds (keepalive.py): their deadline, and a compute thread that
        # shows progress within `stuck_after_s`.
        self.compute = ComputeWatch()
        self.stuck_after_s = default_stuck_after(ack_wait)
        # Completions posted to the loop: kept until done, so a failure is logged, never lost with its future.
        self._completing: set[concurrent.futures.Future[None]] = set()

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

    def start_serving(self, dims: dict[str, int],
                      engines: dict[str, tuple[EngineRuntime, EngineAdapters]] | None = None,
                      uri_for: UriFor | None = None, mixed_bases: frozenset[str] = frozenset()) -> None:
        """Serve: `dims` of the embedding bases; `engines` (base → engine runtime and its adapter cache) are
        started on the loop, each with a lane of its own; `uri_for(adapter, task uri)` finds adapters;
        `mixed_bases`: bases whose batches mix adapters (the runtime computes them in one pass)."""
        self.dims.update(dims)
        self.mixed_bases = mixed_bases
        self.engines = EngineLanes(engines, uri_for)
        self._post(self._models_ready.set)

    def text_out(self, task_id: str) -> Any:
        """The stream of a generating task of a batch in the main thread's hands (its TextOut), or None."""
        self.compute.alive()  # a generate batch starts
        streams = self.streams
        return streams.get(task_id) if streams is not None else None

    def resume(self, batch: Batch) -> bool:
        """Rows that waited for an adapter download (any thread): back to the main thread once a slot is free."""
        scheduler = self._scheduler
        return scheduler is not None and self._post(scheduler.resume, batch)

    def post(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run `fn(*args)` on the loop soon (from the main thread: a streamed delta, a sign of progress)."""
        self.compute.alive()
        return self._post(fn, *args)

    def request_stop(self) -> None:
        self.stop_requested = True  # seen by _main even if the loop does not exist yet
        self._post(self._begin_stop)

    def complete(self, batch: Batch, outcomes: Sequence[Outcome], started: float,
                 encoded: tuple[int, float] | None = None) -> None:
        """Post a computed batch back; `encoded` is (items, seconds) of its compute, when it ran whole."""
        self.compute.alive()
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            future = asyncio.run_coroutine_threadsafe(self._complete(batch, outcomes, started, encoded), loop)
        except RuntimeError:
            log.warning("loop closed; results of a batch of %d dropped (the tasks were given back)", len(batch))
            return
        self._completing.add(future)
        future.add_done_callback(functools.partial(self._completed, len(batch)))

    def _completed(self, n: int, future: concurrent.futures.Future[None]) -> None:
        """Every posted completion ends here (loop thread, or the main thread when already done)."""
        self._completing.discard(future)
        if future.cancelled():  # the loop stopped first: the tasks stay unacked and are delivered again
            log.warning("results of a batch of %d dropped: the loop stopped before settling them", n)
        elif (exc := future.exception()) is not None:  # _complete settles its own failures; this is a last word
            log.error("completing a batch of %d failed: %r", n, exc, exc_info=exc)

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
        self._keeper = ConsumerKeeper(self.js, self.fleet.queue, self.bases)
        setup = asyncio.ensure_future(self._keeper.setup())  # waits for the stream: admin creates it
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait([setup, stop], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not setup.done():
            setup.cancel()
            await asyncio.gather(setup, return_exceptions=True)
            await self.nc.drain()
            return
        setup.result()
        self.owners = OwnerTracker(self.nc.request, self.fleet.worker.orphan_grace_s)
        self._settler = Settler(self.nc, self.js, self.fleet.queue, self.worker_id, self.held, self.dims,
                                owners=self.owners, on_settled=self.on_settled)
        self.streams = TextStreams(self.nc, self.worker_id)
        log.info("connected to %s; consumers ready for %s", self.nats_url, ", ".join(self.bases))
        if self.on_fleet_state is not None:  # promoted bundles: URIs and profiles per adapter id
            try:
                self._fleet_watch = FleetWatcher(self.js, self.on_fleet_state, on_staged=self._staged)
                await self._fleet_watch.start()
                # The initial table before `connected`: a base's `auto` precision follows its served models' verdicts.
                with contextlib.suppress(TimeoutError):
                    await self._fleet_watch.wait_initialised()
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
            batch_psubs = {b: p for b, p in self._psubs.items() if b not in self.engines}
            if batch_psubs:
                self._scheduler = PullScheduler(self.fleet, batch_psubs, self.held, self._settler, self._handoff,
                                                self.profile_for, self._slots, lambda: self._stopping,
                                                owners=self.owners, on_pull_error=self._keeper.pull_failed,
                                                mixed_bases=self.mixed_bases)
            self.engines.start(self._psubs, Intake(self.held, self._settler, self.owners), self._settler,
                               self.streams, lambda: self._stopping, self._keeper.pull_failed, self._fatal)
            await self._publish_heartbeat(0.0)  # the launcher waits for this one to call the worker ready
            log.info("serving %s", ", ".join(self.bases))
            beacon = Beacon(self.nc, "worker", self.worker_id, self._presence_state)
            beacon.start()  # `lorafleet status` from any host; cancelled with the keep-alives below
            background = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._progress_loop()),
                          asyncio.create_task(self._keeper.run()), asyncio.create_task(self.streams.watch())]
            if self._scheduler is not None:
                self._pull_task = asyncio.create_task(self._scheduler.run())
            await self._stop.wait()
            await self._drain()
        for t in background:
            t.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if served:
            await beacon.stop()
        await self.engines.close()
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
            server_urls(self.nats_url), name=f"lorafleet-worker-{self.worker_id}", **RECONNECT_OPTIONS,
            error_cb=self._on_error, disconnected_cb=self._on_disconnect, reconnected_cb=self._on_reconnect,
            **self.client_options,
        ))
        stop = asyncio.ensure_future(self._stop.wait())
        done, _ = await asyncio.wait([connect, stop], timeout=CONNECT_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if connect in done:
            return connect.result()
        connect.cancel()
        await asyncio.gather(connect, return_exceptions=True)
        if stop in done:
            raise ConnectionError(f"cannot connect to NATS at {self.nats_url} (stop requested)")
        why = explain_connect_error(self._last_error, self.nats_url) if self._last_error else (
            f"no answer within {CONNECT_TIMEOUT_S:.0f}s; is nats-server running there?")
        raise ConnectionError(why)

    async def _on_error(self, exc: Exception) -> None:
        self._last_error = exc
        now = time.monotonic()
        if now - self._last_error_logged >= 10.0:  # a refused reconnect repeats every few ms: one line per 10 s
            self._last_error_logged = now
            log.warning("NATS error: %s", explain_connect_error(exc, self.nats_url) if not self.connected.is_set()
                        else exc)

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
        assert self._settler is not None
        timeout = self.fleet.worker.drain_timeout_s
        deadline = time.monotonic() + timeout
        pulls = [t for t in [self._pull_task, *self.engines.pulling()] if t is not None and not t.done()]
        if pulls:
            # A pull that was fetching when the stop came ends within a fetch timeout and hands its batch over
            # (then held). Waiting only IDLE_POLL_S + 2 s let a host freeze outlast it: its fetched batch was
            # neither answered nor given back, ack-pending until redelivery (seen in CI). So it gets the drain's time.
            await asyncio.wait(pulls, timeout=max(IDLE_POLL_S + 2.0, timeout))
        if self._scheduler is not None:
            await self._scheduler.give_back_waiting()
        if await self.held.wait_empty(max(0.0, deadline - time.monotonic())):
            log.info("drained: all in-flight tasks answered")
            return
        log.warning("drain timed out after %.1fs; giving back %d task(s)", timeout, len(self.held))
        await self.engines.cancel_sequences()
        while True:
            try:
                self.ready.get_nowait()
            except queue.Empty:
                break
        await self._settler.settle_many([Settlement(h.msg, "", Situation.SHUTDOWN,
                                                    reason="worker shut down before computing the task")
                                         for h in self.held.values()])

    async def _complete(self, batch: Batch, outcomes: Sequence[Outcome], started: float,
                        encoded: tuple[int, float] | None) -> None:
        """Settle a batch the main thread computed; should that fail, its tasks still held are given back."""
        self._slots.release()
        self.compute.returned(batch)
        scheduler = self._scheduler
        try:
            if encoded is not None and scheduler is not None and batch.base in scheduler.batch_times:
                scheduler.batch_times[batch.base].observe(*encoded)
            assert self._settler is not None
            if batch.op == GENERATE and self.streams is not None:
                for item, outcome in zip(batch.items, outcomes, strict=True):
                    out = self.streams.get(item.task.id)
                    if out is not None:
                        try:
                            chunks = await out.flushed()  # every chunk before the final result
                            if outcome.text is not None:
                                outcome.text.chunks = chunks
                        finally:
                            self.streams.close(out)
            await self._settler.complete(batch, outcomes, started)
        except Exception as exc:
            log.error("settling a batch of %d (%s) failed: %r; its tasks go back to the queue", len(batch),
                      batch.base, exc, exc_info=True)
            await self._give_back(batch)
        finally:
            if scheduler is not None and batch.base in scheduler.service_rates:
                scheduler.service_rates[batch.base].end(sum(o.situation is Situation.OK for o in outcomes))
            self.batches_done += 1

    async def _give_back(self, batch: Batch) -> None:
        """Nak the batch's tasks this worker still holds (the settler may be what failed: straight to the msgs)."""
        held = {id(h.msg) for h in self.held.values()}
        for item in batch.items:
            if id(item.msg) not in held:
                continue  # settled before the failure
            try:
                await item.msg.nak(delay=self.fleet.queue.nak_delay_s)
            except Exception as exc:  # not even that: JetStream delivers it again after ack_wait
                log.warning("giving back task %s failed: %r", item.task.id, exc)
            finally:
                self.held.discard(item.msg)

    def _handoff(self, batch: Batch) -> None:
        """A batch goes to the main thread; a generate batch's tasks get their streams first."""
        if batch.op == GENERATE and self.streams is not None:
            for item in batch.items:
                self.streams.open(item.task, num_delivered(item.msg), bool(item.params and item.params.stream))
        self.compute.handed(batch)
        self.ready.put_nowait(batch)

    def _staged(self, entry: FleetEntry) -> None:
        """A promotion stages a version: an engine loads it on this loop, a batch runtime via `on_preload`."""
        lane = self.engines.lanes.get(entry.base)  # lanes: this worker's engine bases only
        if entry.base in self.bases and entry.base not in self.engines and self.on_preload is not None:
            self.on_preload(entry)
        elif lane is not None and lane.ready:  # an engine not serving yet is not in heartbeats: nobody waits
            self._preloads.add(task := asyncio.create_task(preload_engine(lane.adapters, entry)))
            task.add_done_callback(self._preloads.discard)

    def _fatal(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._begin_stop()

    # ---- keep-alives --------------------------------------------------------------------------
    async def _progress_loop(self) -> None:
        """in_progress for held tasks, never past their deadline nor while the compute thread is stuck."""
        await KeepAlive(self.held, self._progress_every, self.compute, lambda: self.stuck_after_s).run()

    def _compute_stuck(self) -> bool:
        return self.compute.check(time.monotonic(), self.stuck_after_s)

    def _presence_state(self) -> str:
        return "draining" if self._stopping else "stuck" if self._compute_stuck() else "serving"

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
        # Only the bases this worker can pull for right now (their consumer exists; an engine's once it serves):
        # a gateway counts a base as served, and itself as ready, by these.
        bases = self._keeper.healthy_bases() if self._keeper is not None else list(self.bases)
        bases = [b for b in bases if self.engines.serves(b)]
        if self._compute_stuck():  # the stuck thread computes every base but the engines': claim none of those
            bases = [b for b in bases if b in self.engines]
        rates: dict[str, float] = {}
        service = dict(self._scheduler.service_rates) if self._scheduler is not None else {}
        service.update(self.engines.service_rates())
        for base, rate in service.items():
            value = rate.per_s()
            if value is not None:
                rates[base] = round(value, 2)
        engine_adapters, used, slots, kv = await self.engines.report()
        adapters = {**self.adapters_snapshot, **engine_adapters}
        hb = Heartbeat(
            worker=self.worker_id, bases=bases, adapters=adapters,
            in_flight=len(self.held), batches_per_s=round(batches_per_s, 3), tasks_done=self.tasks_done,
            pid=os.getpid(), host=socket.gethostname(), draining=self._stopping, service_rates=rates,
            slots_used=used, slots=slots, kv_cache=kv, precisions=dict(self.precisions),
        )
        try:
            await self.nc.publish(heartbeat_subject(self.worker_id), hb.to_wire())
        except Exception as exc:
            log.debug("heartbeat publish failed: %s", exc)
