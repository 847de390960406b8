"""The worker process: torch inference in the main thread, NATS in a background asyncio thread.

MEASURED.md: torch called from a non-main thread ran 15–30 % slower here, so a batch runtime runs
where it gets the cores (the main thread) and the event loop only moves bytes. The loop pre-pulls up
to `batches_in_flight` batches beyond the one the main thread computes (pipelining); outcomes go
back with `call_soon_threadsafe`. Engine runtimes (their own process, their own batching) are
driven by the loop instead (engine_lane.py); the main thread only creates them.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np

from lorafleet.adapters import AdapterPolicy, AdapterUnavailable, local_path_of
from lorafleet.config import ConfigError, FleetConfig, ServingProfile
from lorafleet.fleet_state import by_adapter_id
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.adapters import AdapterCache
from lorafleet.sidecar.batcher import Batch
from lorafleet.sidecar.connection import NatsSide
from lorafleet.sidecar.engine_adapters import EngineAdapters
from lorafleet.sidecar.generation import generate_batch
from lorafleet.sidecar.metrics import MetricsServer, WorkerMetrics
from lorafleet.sidecar.runtime import EngineRuntime, Runtime, create_runtime
from lorafleet.sidecar.settle import Outcome
from lorafleet.wire import GENERATE

log = logging.getLogger(__name__)

CONNECT_GRACE_S = 35.0  # the loop gives up connecting after 30 s


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def select_bases(fleet: FleetConfig, bases: list[str] | None) -> list[str]:
    known = [b.name for b in fleet.bases]
    if not bases:
        if not known:
            raise ConfigError("the fleet config lists no bases; add one under 'bases:'")
        return known
    unknown = [b for b in bases if b not in known]
    if unknown:
        raise ConfigError(f"--base {', '.join(unknown)}: not among the fleet's bases {known}")
    return list(dict.fromkeys(bases))


class FleetLookup:
    """Per-adapter profile and URI from the fleet config (ServedModel), falling back to the worker's."""

    def __init__(self, fleet: FleetConfig) -> None:
        self.default = fleet.worker.profile
        self.served = {m.resolved_adapter_id: m for m in fleet.models}
        self._static = dict(self.served)

    def apply_fleet_state(self, table: dict[str, Any]) -> None:
        """Promoted bundles from the fleet KV bucket: adapter id → URI and serving profile (one swap)."""
        self.served = {**self._static, **by_adapter_id(table.values())}

    def profile_for(self, base: str, adapter: str | None) -> ServingProfile:
        served = self.served.get(adapter) if adapter else None
        return served.profile if served is not None and served.profile is not None else self.default

    def uri_for(self, adapter: str, task_uri: str | None) -> str | None:
        """Where to load `adapter` from: what this worker's own fleet file or fleet state says, else the task's
        URI (checked against the allow-list, `adapter_policy`, like every URI)."""
        served = self.served.get(adapter)
        if served is not None:
            return served.adapter
        return task_uri or None


def adapter_policy(fleet: FleetConfig) -> AdapterPolicy:
    """The allow-list of adapter sources: registry references, `worker.adapter_roots`, and the local adapter
    folders this fleet file names itself (the operator wrote them there)."""
    own = [path for m in fleet.models if (path := local_path_of(m.adapter)) is not None]
    return AdapterPolicy([*fleet.worker.adapter_roots, *own])


class Computer:
    """Runs batches on the (batch) runtimes; main thread only."""

    def __init__(self, runtimes: dict[str, Runtime], caches: dict[str, AdapterCache], lookup: FleetLookup,
                 side: NatsSide | None = None) -> None:
        self.runtimes = runtimes
        self.caches = caches
        self.lookup = lookup
        self.side = side  # where generated text is streamed to
        self.adapters_changed = False
        self.last_encode: tuple[int, float] | None = None  # (items, seconds) of the last batch encoded whole

    def run(self, batch: Batch) -> tuple[list[Outcome], float]:
        started = time.time()
        self.last_encode = None
        outcomes: list[Outcome | None] = [None] * len(batch.items)
        live: list[int] = []
        for i, item in enumerate(batch.items):
            if item.task.deadline <= started:
                outcomes[i] = Outcome(Situation.DEADLINE, message="deadline passed before compute")
            else:
                live.append(i)
        if live and batch.adapter is not None:
            failed = self._load_adapter(batch)
            if failed is not None:
                for i in live:
                    outcomes[i] = failed
                live = []
        if live and batch.op == GENERATE:
            t0 = time.perf_counter()
            generated = generate_batch(self.runtimes[batch.base], batch, live, self.side)
            for i, outcome in zip(live, generated, strict=True):
                outcomes[i] = outcome
            if all(o.situation is Situation.OK for o in generated):
                self.last_encode = (len(live), time.perf_counter() - t0)
        elif live:
            runtime = self.runtimes[batch.base]
            t0 = time.perf_counter()
            vectors = self._encode_split(runtime, [batch.items[i].task.text for i in live], batch.adapter)
            if all(isinstance(v, bytes) for v in vectors):  # a bisected batch's time says nothing of its size
                self.last_encode = (len(live), time.perf_counter() - t0)
            for i, v in zip(live, vectors, strict=True):
                outcomes[i] = Outcome(Situation.OK, vector=v) if isinstance(v, bytes) else \
                    Outcome(Situation.RUNTIME_FAILED, message=f"{type(v).__name__}: {v}")
        return [o for o in outcomes if o is not None], started

    def _load_adapter(self, batch: Batch) -> Outcome | None:
        adapter = batch.adapter
        assert adapter is not None
        cache = self.caches[batch.base]
        task_uri = next((p.task.adapter_uri for p in batch.items if p.task.adapter_uri), None)
        try:
            t0 = time.perf_counter()
            if cache.ensure(adapter, self.lookup.uri_for(adapter, task_uri)):
                self.adapters_changed = True
                log.info("adapter %s loaded on %s in %.2fs", adapter, batch.base, time.perf_counter() - t0)
            return None
        except AdapterUnavailable as exc:
            log.warning("adapter %s unavailable: %s", adapter, exc)
            return Outcome(Situation.ADAPTER_UNAVAILABLE, message=str(exc))
        except Exception as exc:
            log.warning("adapter %s failed to load (will retry): %s", adapter, exc, exc_info=True)
            return Outcome(Situation.ADAPTER_FAILED, message=f"{type(exc).__name__}: {exc}")

    def _encode_split(self, runtime: Runtime, texts: list[str], adapter: str | None) -> list[bytes | Exception]:
        """Encode; when a batch fails, bisect it so one bad input (or an OOM) does not fail its neighbours."""
        try:
            arr = runtime.encode(texts, adapter)
            if arr.shape != (len(texts), runtime.dim):
                raise RuntimeError(f"runtime returned shape {arr.shape}, expected {(len(texts), runtime.dim)}")
            arr = np.ascontiguousarray(arr, dtype="<f4")
            return [row.tobytes() for row in arr]
        except Exception as exc:
            if len(texts) == 1:
                log.warning("encode failed for one input: %s", exc)
                return [exc]
            log.warning("batch of %d failed (%s); retrying as halves", len(texts), exc)
            mid = len(texts) // 2
            return self._encode_split(runtime, texts[:mid], adapter) + self._encode_split(runtime, texts[mid:], adapter)

    def snapshot(self) -> dict[str, list[str]]:
        return {base: cache.loaded() for base, cache in self.caches.items()}


def run_worker(fleet: FleetConfig, *, nats_url: str | None = None, worker_id: str | None = None,
               bases: list[str] | None = None, client_options: dict[str, Any] | None = None,
               metrics_addr: tuple[str, int] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code. Must run in the main thread.

    `client_options`: keyword arguments for `nats.connect` (credential, TLS), from
    `nats_client.ClientSettings`; None connects without credentials. `metrics_addr` (host, port): serve
    Prometheus metrics on `/metrics` there (port 0: any free port, logged); None: nothing listens.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("run_worker must run in the main thread (inference and signal handling live there)")
    worker_id = worker_id or default_worker_id()
    serve = select_bases(fleet, bases)
    lookup = FleetLookup(fleet)
    side = NatsSide(fleet, nats_url or fleet.nats_url, worker_id, serve, lookup.profile_for, client_options)
    side.on_fleet_state = lookup.apply_fleet_state
    metrics = WorkerMetrics(serve)
    side.on_settled = metrics.task_settled
    server: MetricsServer | None = None
    if metrics_addr is not None:
        try:
            server = MetricsServer(metrics, *metrics_addr)
        except OSError as exc:
            raise ConfigError(str(exc)) from exc
        log.info("metrics on %s", server.url)
    signals = {"count": 0}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals["count"] += 1
        if signals["count"] > 1:
            log.warning("second %s: exiting at once; unacked tasks will be redelivered", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s received: draining", signal.Signals(signum).name)
        side.request_stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _serve(fleet, side, serve, lookup, metrics)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if server is not None:
            server.close()


def _serve(fleet: FleetConfig, side: NatsSide, serve: list[str], lookup: FleetLookup, metrics: WorkerMetrics) -> int:
    log.info("worker %s starting for %s (nats %s)", side.worker_id, ", ".join(serve), side.nats_url)
    side.start()  # connects while the models load
    runtimes: dict[str, Runtime] = {}
    engines: dict[str, EngineRuntime] = {}
    try:
        for name in serve:
            t0 = time.perf_counter()
            runtime = create_runtime(fleet.base(name), fleet.worker.device)
            if isinstance(runtime, EngineRuntime):  # started on the NATS loop, which drives it
                engines[name] = runtime
                continue
            runtimes[name] = runtime
            log.info("base %s ready in %.1fs", name, time.perf_counter() - t0)
    except Exception as exc:
        log.error("loading base models failed: %s", exc, exc_info=True)
        side.request_stop()
        side.thread.join(timeout=10)
        return 1
    if side.stop_requested:
        log.info("stopped before serving")
        side.thread.join(timeout=CONNECT_GRACE_S)
        return 0
    if not side.wait_connected():
        log.error("could not set up NATS at %s: %s", side.nats_url, side.error)
        return 1
    policy = adapter_policy(fleet)
    caches = {b: AdapterCache(rt, fleet.worker.max_adapters, resolve=policy.resolve,
                              events=metrics.adapter_events(b)) for b, rt in runtimes.items()}
    computer = Computer(runtimes, caches, lookup, side)
    metrics.watch(lambda: len(side.held), {b: _engine_slots(side, b) for b in engines})
    side.start_serving({b: rt.dim for b, rt in runtimes.items() if "embed" in rt.capabilities},
                       {b: (rt, EngineAdapters(rt, fleet.worker.max_adapters, policy.resolve,
                                               events=metrics.adapter_events(b)))
                        for b, rt in engines.items()},
                       lookup.uri_for)
    batches = tasks = 0
    busy_s = 0.0
    while True:
        try:
            batch = side.ready.get(timeout=0.5)
        except queue.Empty:
            if not side.thread.is_alive():
                break
            continue
        if batch is None:
            break
        t0 = time.perf_counter()
        outcomes, started = computer.run(batch)
        took = time.perf_counter() - t0
        busy_s += took
        metrics.batch_done(batch.base, len(batch), took)
        if computer.adapters_changed:
            computer.adapters_changed = False
            side.adapters_snapshot = computer.snapshot()
        side.complete(batch, outcomes, started, computer.last_encode)
        batches += 1
        tasks += len(batch)
    side.thread.join(timeout=fleet.worker.drain_timeout_s + 10)
    for rt in runtimes.values():
        rt.close()
    dropped = side.owners.dropped if side.owners is not None else 0
    log.info("worker %s stopped: %d batches, %d tasks, %.1fs computing; %d tasks of gone gateways dropped uncomputed",
             side.worker_id, batches, tasks, busy_s, dropped)
    if side.error is not None:
        return 1
    return 0


def _engine_slots(side: NatsSide, base: str) -> Callable[[], tuple[int, int]]:
    """(slots in use, slots) of an engine base's lane, read at scrape time; (0, 0) before it exists."""

    def read() -> tuple[int, int]:
        lane = side.engines.lanes.get(base)
        return (lane.in_use, lane.slots) if lane is not None else (0, 0)

    return read
