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

from lorafleet.core.adapters import AdapterPolicy, local_path_of
from lorafleet.core.config import ConfigError, FleetConfig, ServingProfile
from lorafleet.core.fleet_state import by_adapter_id
from lorafleet.models.precision import JudgedModel
from lorafleet.sidecar.adapters import AdapterCache
from lorafleet.sidecar.compute import Computer
from lorafleet.sidecar.connection import NatsSide
from lorafleet.sidecar.engine_adapters import EngineAdapters
from lorafleet.sidecar.metrics import MetricsServer, WorkerMetrics
from lorafleet.sidecar.preload import Preloader
from lorafleet.sidecar.runtime import EngineRuntime, Runtime, create_runtime

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

    def judged_for(self, base: str) -> list[JudgedModel]:
        """Each model served on `base`: its tuned precision (None: none recorded) and adapter, for `use_judged`."""
        return [JudgedModel(m.profile.precision if m.profile is not None else None, m.adapter, m.resolved_adapter_id)
                for m in self.served.values() if m.base == base]

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
    preloader = Preloader(serve, adapter_policy(fleet).resolve)  # what a promotion stages (sidecar/preload.py)
    side.on_preload = preloader.request
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
        return _serve(fleet, side, serve, lookup, metrics, preloader)
    finally:
        preloader.close()
        for s, h in previous.items():
            signal.signal(s, h)
        if server is not None:
            server.close()


def _serve(fleet: FleetConfig, side: NatsSide, serve: list[str], lookup: FleetLookup, metrics: WorkerMetrics,
           preloader: Preloader) -> int:
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
    for name, rt in {**runtimes, **engines}.items():  # `auto` follows what the served models were judged at
        rt.use_judged(lookup.judged_for(name), policy.resolve)
    side.precisions = {b: rt.precision for b, rt in {**runtimes, **engines}.items()}  # heartbeats carry them
    profile = fleet.worker.profile  # the adapter tiers and mixed batches are worker-wide
    caches = {b: AdapterCache(rt, fleet.worker.max_adapters, resolve=policy.resolve, events=metrics.adapter_events(b),
                              device_bytes=profile.adapter_device_bytes, host_bytes=profile.adapter_host_bytes)
              for b, rt in runtimes.items()}
    computer = Computer(runtimes, caches, lookup, side)
    mixed = frozenset(b for b, rt in runtimes.items() if rt.mixed_adapters and profile.mixed_adapter_batches)
    metrics.watch(lambda: len(side.held), {b: _engine_slots(side, b) for b in engines})
    side.start_serving({b: rt.dim for b, rt in runtimes.items() if "embed" in rt.capabilities},
                       {b: (rt, EngineAdapters(rt, fleet.worker.max_adapters, policy.resolve,
                                               events=metrics.adapter_events(b)))
                        for b, rt in engines.items()},
                       lookup.uri_for, mixed_bases=mixed)
    batches = tasks = 0
    busy_s = 0.0
    while True:
        if preloader.run_pending(caches):  # between batches: the next heartbeat lists what a promotion staged
            side.adapters_snapshot = computer.snapshot()
        try:
            batch = side.ready.get(timeout=0.5)
        except queue.Empty:
            if not side.thread.is_alive():
                break
            continue
        if batch is None:
            break
        t0 = time.perf_counter()
        outcomes, started = computer.run(batch)  # rows waiting for an adapter download leave the batch (compute.py)
        took = time.perf_counter() - t0
        busy_s += took
        if batch.items:
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
