"""Prometheus metrics of one worker, in their own registry, served on `/metrics` when asked (`--metrics-port`).

Counted at the narrowest points: every task leaves through the settler (`task_settled`), every batch of a
batch runtime through the main thread (`batch_done`), every adapter load and eviction through the adapter
caches (`adapter_events`). Gauges that describe the present (tasks held, engine slots in use) are read at
scrape time, so the serving path pays nothing for them. Nothing listens unless `--metrics-port` is given
(security by default); the HTTP server is prometheus_client's, in a daemon thread of its own, so a scrape
never touches the main thread (torch) or the NATS loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.adapters import SOURCES, TIERS

# Names, for dashboards (deploy/grafana/lorafleet.json is checked against them) and the report.
TASKS = "lorafleet_worker_tasks"  # _total{base, outcome}: outcome = acks.Situation value (ok, deadline, …)
ERRORS = "lorafleet_worker_errors"  # _total{base, code}: failed tasks by code (the outcomes in ERROR_OUTCOMES)
BATCH_SIZE = "lorafleet_worker_batch_size"  # histogram{base}: tasks per computed batch (batch runtimes)
BATCH_SECONDS = "lorafleet_worker_batch_seconds"  # histogram{base}: compute time of one batch
TASKS_IN_FLIGHT = "lorafleet_worker_tasks_in_flight"  # gauge: tasks pulled and not yet settled
SLOTS = "lorafleet_worker_slots"  # gauge{base}: sequences an engine base keeps in flight at most
SLOTS_IN_USE = "lorafleet_worker_slots_in_use"  # gauge{base}: sequences in flight on an engine base
ADAPTERS_LOADED = "lorafleet_worker_adapters_loaded"  # gauge{base}
ADAPTER_LOADS = "lorafleet_worker_adapter_loads"  # _total{base}
ADAPTER_EVICTIONS = "lorafleet_worker_adapter_evictions"  # _total{base}: from the device
# Adapter memory tiers (sidecar/adapters.py) of batch runtimes: device (hot) → host (warm) → disk → registry.
ADAPTER_LOADS_BY_SOURCE = "lorafleet_worker_adapter_loads_by_source"  # _total{base, source}: host, disk, registry
ADAPTER_TIER_EVICTIONS = "lorafleet_worker_adapter_tier_evictions"  # _total{base, tier}: device, host
ADAPTER_TIER_BYTES = "lorafleet_worker_adapter_tier_bytes"  # gauge{base, tier}
ADAPTER_TIER_ADAPTERS = "lorafleet_worker_adapter_tier_adapters"  # gauge{base, tier}

NAMES = (TASKS, ERRORS, BATCH_SIZE, BATCH_SECONDS, TASKS_IN_FLIGHT, SLOTS, SLOTS_IN_USE, ADAPTERS_LOADED, ADAPTER_LOADS,
         ADAPTER_EVICTIONS, ADAPTER_LOADS_BY_SOURCE, ADAPTER_TIER_EVICTIONS, ADAPTER_TIER_BYTES, ADAPTER_TIER_ADAPTERS)

# The outcomes that are failures (a task answered with an error, or to be retried after one); the others are flow
# (ok, cancelled, owner away, orphaned, shutdown). Clients see only a code and a request id (serve/errors.py): the
# worker's log has each failure's text under its task id (REQUEST_ID.INDEX), this counter how often each code occurs.
ERROR_OUTCOMES = frozenset({Situation.DEADLINE, Situation.MALFORMED, Situation.ADAPTER_UNAVAILABLE,
                            Situation.ADAPTER_FAILED, Situation.RUNTIME_FAILED, Situation.INVALID,
                            Situation.UNDELIVERED})

DEFAULT_PORT = 9464  # the port the deploy manifests scrape (Prometheus' conventional exporter range)

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.0, 5.0, 10.0, 30.0, 60.0)


class AdapterEvents:
    """What an adapter cache reports about one base: a load (and from where), an eviction (and from which tier),
    how many adapters the device holds now, and each tier's size."""

    __slots__ = ("_evictions", "_loaded", "_loads", "_sources", "_tier_adapters", "_tier_bytes", "_tier_evictions")

    def __init__(self, loads: Any, evictions: Any, loaded: Any, sources: dict[str, Any] | None = None,
                 tier_evictions: dict[str, Any] | None = None, tier_bytes: dict[str, Any] | None = None,
                 tier_adapters: dict[str, Any] | None = None) -> None:
        self._loads, self._evictions, self._loaded = loads, evictions, loaded
        self._sources = sources or {}
        self._tier_evictions = tier_evictions or {}
        self._tier_bytes, self._tier_adapters = tier_bytes or {}, tier_adapters or {}

    def loaded(self, held: int) -> None:
        self._loads.inc()
        self._loaded.set(held)

    def evicted(self, held: int) -> None:
        self._evictions.inc()
        self._loaded.set(held)

    def loaded_from(self, source: str) -> None:
        if source in self._sources:
            self._sources[source].inc()

    def evicted_from(self, tier: str) -> None:
        if tier in self._tier_evictions:
            self._tier_evictions[tier].inc()

    def tier_size(self, tier: str, adapters: int, nbytes: int) -> None:
        if tier in self._tier_bytes:
            self._tier_bytes[tier].set(nbytes)
            self._tier_adapters[tier].set(adapters)


class WorkerMetrics:
    """The worker's series; every method is safe from any thread (prometheus_client locks per child)."""

    def __init__(self, bases: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.tasks = Counter(TASKS, "Tasks settled, by base and outcome (one per delivery: a retried task counts "
                             "again).", ["base", "outcome"], registry=r)
        self.errors = Counter(ERRORS, "Failed tasks, by base and code (an acks.Situation value: runtime_failed, "
                              "adapter_unavailable, …; one per delivery). The worker's log has each one's text.",
                              ["base", "code"], registry=r)
        self.batch_size = Histogram(BATCH_SIZE, "Tasks per computed batch.", ["base"], buckets=_BATCH_BUCKETS,
                                    registry=r)
        self.batch_seconds = Histogram(BATCH_SECONDS, "Compute time of one batch (adapter load included).",
                                       ["base"], buckets=_SECONDS_BUCKETS, registry=r)
        self.in_flight = Gauge(TASKS_IN_FLIGHT, "Tasks pulled and not yet settled.", registry=r)
        self.slots = Gauge(SLOTS, "Sequences an engine base keeps in flight at most.", ["base"], registry=r)
        self.slots_in_use = Gauge(SLOTS_IN_USE, "Sequences in flight on an engine base.", ["base"], registry=r)
        self.adapters_loaded = Gauge(ADAPTERS_LOADED, "Adapters loaded on a base's runtime.", ["base"], registry=r)
        self.adapter_loads = Counter(ADAPTER_LOADS, "Adapters loaded.", ["base"], registry=r)
        self.adapter_evictions = Counter(ADAPTER_EVICTIONS, "Adapters evicted to make room (LRU).", ["base"],
                                         registry=r)
        self.adapter_loads_by_source = Counter(
            ADAPTER_LOADS_BY_SOURCE, "Adapters loaded onto the device, by where they came from: host (memory), disk "
            "(a local folder), registry (a plugin scheme's download).", ["base", "source"], registry=r)
        self.adapter_tier_evictions = Counter(
            ADAPTER_TIER_EVICTIONS, "Adapters that left a memory tier to make room (LRU): device (moved to host "
            "memory, or dropped), host (dropped).", ["base", "tier"], registry=r)
        self.adapter_tier_bytes = Gauge(ADAPTER_TIER_BYTES, "Bytes of adapter weights held per memory tier.",
                                        ["base", "tier"], registry=r)
        self.adapter_tier_adapters = Gauge(ADAPTER_TIER_ADAPTERS, "Adapters held per memory tier.", ["base", "tier"],
                                           registry=r)
        for base in bases:  # export zeros, so a dashboard shows the families before the first task
            self.tasks.labels(base, "ok")
            self.errors.labels(base, Situation.RUNTIME_FAILED)
            self.batch_size.labels(base)
            self.batch_seconds.labels(base)
            self.adapter_events(base)
        self._task_children: dict[tuple[str, str], Any] = {}
        self._error_children: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def task_settled(self, base: str, outcome: str) -> None:
        key = (base, outcome)
        child = self._task_children.get(key)
        if child is None:
            with self._lock:
                child = self._task_children.setdefault(key, self.tasks.labels(base, outcome))
        child.inc()
        if outcome in ERROR_OUTCOMES:
            error = self._error_children.get(key)
            if error is None:
                with self._lock:
                    error = self._error_children.setdefault(key, self.errors.labels(base, outcome))
            error.inc()

    def batch_done(self, base: str, size: int, seconds: float) -> None:
        self.batch_size.labels(base).observe(size)
        self.batch_seconds.labels(base).observe(seconds)

    def adapter_events(self, base: str) -> AdapterEvents:
        return AdapterEvents(self.adapter_loads.labels(base), self.adapter_evictions.labels(base),
                             self.adapters_loaded.labels(base),
                             sources={s: self.adapter_loads_by_source.labels(base, s) for s in SOURCES},
                             tier_evictions={t: self.adapter_tier_evictions.labels(base, t) for t in TIERS},
                             tier_bytes={t: self.adapter_tier_bytes.labels(base, t) for t in TIERS},
                             tier_adapters={t: self.adapter_tier_adapters.labels(base, t) for t in TIERS})

    def watch(self, in_flight: Callable[[], float],
              engine_slots: dict[str, Callable[[], tuple[int, int]]] | None = None) -> None:
        """Gauges read at scrape time: tasks held; per engine base, (slots in use, slots)."""
        self.in_flight.set_function(in_flight)
        for base, read in (engine_slots or {}).items():
            self.slots_in_use.labels(base).set_function(lambda r=read: r()[0])
            self.slots.labels(base).set_function(lambda r=read: r()[1])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """`/metrics` over HTTP in a daemon thread; `port` 0 picks a free port (`self.port` says which)."""

    def __init__(self, metrics: WorkerMetrics, host: str, port: int) -> None:
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=metrics.registry)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} (choose another "
                          "--metrics-port, or --metrics-host)") from exc
        self.host = host
        self.port = int(self._server.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
