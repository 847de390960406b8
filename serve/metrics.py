"""Prometheus metrics of one gateway, in their own registry (several apps may share a process)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lorafleet.core.heartbeats import STATS_BUCKETS, GatewayStats, VersionCounts, bucket_index
from lorafleet.core.wire import consumer_name
from lorafleet.serve.routekeys import RouteKeyTally

# Names, for dashboards and the report.
REQUESTS = "lorafleet_gateway_requests"  # _total{route, model, code}
REQUEST_SECONDS = "lorafleet_gateway_request_seconds"  # histogram{route}
QUEUE_WAIT_SECONDS = "lorafleet_gateway_queue_wait_seconds"  # histogram{base}, from Result.queue_ms
BATCH_SIZE = "lorafleet_gateway_batch_size"  # histogram{base}, from Result.batch_size
TASKS_IN_FLIGHT = "lorafleet_gateway_tasks_in_flight"  # gauge
DROPPED_RESULTS = "lorafleet_gateway_dropped_results"  # _total{reason=late|duplicate|malformed}
TASKS_PUBLISHED = "lorafleet_gateway_tasks_published"  # _total{base}
REFUSED = "lorafleet_gateway_refused"  # _total{base}: 429 from admission control
BACKLOG = "lorafleet_gateway_backlog_tasks"  # gauge{base}: tasks ahead of a new request
SERVICE_RATE = "lorafleet_gateway_service_rate"  # gauge{base}: tasks/s the live workers complete (-1: unknown)
# gauge{base, consumer}: num_pending + num_ack_pending of the base's durable consumer, as JetStream reported it at
# the last read (what KEDA's nats-jetstream trigger scales on, for Prometheus-based autoscalers and dashboards)
CONSUMER_LAG = "lorafleet_gateway_consumer_lag"
# Per registry version of a promoted name (issue 25: a canary's two sides, pinned versions). `version` is bounded:
# only versions the fleet state serves (champion, canary, retained), never a client's string.
VERSION_REQUESTS = "lorafleet_gateway_version_requests"  # _total{model, version, code}
VERSION_SECONDS = "lorafleet_gateway_version_request_seconds"  # histogram{model, version}
VERSION_TOKENS = "lorafleet_gateway_version_tokens"  # _total{model, version}: prompt (+ completion) tokens

NAMES = (REQUESTS, REQUEST_SECONDS, QUEUE_WAIT_SECONDS, BATCH_SIZE, TASKS_IN_FLIGHT, DROPPED_RESULTS,
         TASKS_PUBLISHED, REFUSED, BACKLOG, SERVICE_RATE, CONSUMER_LAG, VERSION_REQUESTS, VERSION_SECONDS,
         VERSION_TOKENS)

_LATENCY_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                    0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self, tasks_in_flight: Callable[[], float]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(REQUESTS, "HTTP requests by route, served model and status code.",
                                ["route", "model", "code"], registry=r)
        self.request_seconds = Histogram(REQUEST_SECONDS, "Request latency inside the gateway.", ["route"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_wait_seconds = Histogram(QUEUE_WAIT_SECONDS, "Task wait from enqueue to batch start.",
                                            ["base"], buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(BATCH_SIZE, "Size of the worker batch each result came from.", ["base"],
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.dropped_results = Counter(DROPPED_RESULTS, "Results dropped: late (request gone), duplicate, malformed.",
                                       ["reason"], registry=r)
        self.tasks_published = Counter(TASKS_PUBLISHED, "Tasks published to the work stream.", ["base"], registry=r)
        self.refused_requests = Counter(REFUSED, "Requests refused by admission control (429).", ["base"], registry=r)
        self.backlog = Gauge(BACKLOG, "Tasks queued or being computed ahead of a new request.", ["base"], registry=r)
        self.service_rate = Gauge(SERVICE_RATE, "Tasks per second the live workers of a base complete (-1: not "
                                  "measured yet).", ["base"], registry=r)
        self.consumer_lag = Gauge(CONSUMER_LAG, "Tasks of a base's consumer not yet acked (waiting + delivered), "
                                  "from JetStream at the last read.", ["base", "consumer"], registry=r)
        self.version_requests = Counter(VERSION_REQUESTS, "Requests by promoted name, registry version and status "
                                        "code (a canary's sides; 5xx are errors).", ["model", "version", "code"],
                                        registry=r)
        self.version_seconds = Histogram(VERSION_SECONDS, "Request latency inside the gateway by promoted name and "
                                         "registry version.", ["model", "version"], buckets=_LATENCY_BUCKETS,
                                         registry=r)
        self.version_tokens = Counter(VERSION_TOKENS, "Tokens computed by promoted name and registry version.",
                                      ["model", "version"], registry=r)
        # Computed at scrape time from the pending table: zero cost on the request path.
        self.tasks_in_flight = Gauge(TASKS_IN_FLIGHT, "Tasks published and still awaiting their result.",
                                     registry=r)
        self.tasks_in_flight.set_function(tasks_in_flight)
        for reason in ("late", "duplicate", "malformed"):
            self.dropped_results.labels(reason)  # export zeros so the families always show

        # Label children cached per key: .labels() costs a lock and a tuple build on every call.
        self._request_children: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self._result_children: dict[str, tuple[Any, Any]] = {}
        self._published_children: dict[str, Any] = {}
        self.published_total: dict[str, int] = {}  # tasks published per base, as a plain int (no registry lock)
        self._version_children: dict[tuple[str, str, int], tuple[Any, Any, Any]] = {}
        # The same per-version figures as plain counters, published over NATS for `promote --watch`, which sums
        # them over all gateways: [requests, errors, latency bucket counts...] per (model, version).
        self._version_counts: dict[tuple[str, str], list[int]] = {}
        # Requests a canary split decided, per route key (a digest): published with them, read by `status`.
        self.route_keys = RouteKeyTally()

    def request_done(self, route: str, model: str, code: int, seconds: float, version: str | None = None,
                     tokens: int = 0, empty: bool = False) -> None:
        if version is not None:
            self.version_done(model, version, code, seconds, tokens, empty)
        key = (route, model, code)
        children = self._request_children.get(key)
        if children is None:
            children = (self.requests.labels(route, model, str(code)), self.request_seconds.labels(route))
            self._request_children[key] = children
        children[0].inc()
        children[1].observe(seconds)

    def version_done(self, model: str, version: str, code: int, seconds: float, tokens: int = 0,
                     empty: bool = False) -> None:
        key = (model, version, code)
        children = self._version_children.get(key)
        if children is None:
            children = (self.version_requests.labels(model, version, str(code)),
                        self.version_seconds.labels(model, version), self.version_tokens.labels(model, version))
            self._version_children[key] = children
        children[0].inc()
        children[1].observe(seconds)
        counts = self._version_counts.get((model, version))
        if counts is None:
            counts = self._version_counts[(model, version)] = [0] * (len(STATS_BUCKETS) + 4)
        counts[0] += 1
        if empty:  # a generative answer with no text (issue 25: `--watch` compares their rate)
            counts[-1] += 1
        if code >= 500:
            counts[1] += 1
        counts[2 + bucket_index(seconds)] += 1
        if tokens:
            children[2].inc(tokens)

    def version_stats(self, gateway_id: str) -> GatewayStats | None:
        """This gateway's cumulative per-version counters (None before any versioned request)."""
        if not self._version_counts:
            return None
        return GatewayStats(gateway_id, {k: VersionCounts(c[0], c[1], tuple(c[2:-1]), c[-1])
                                         for k, c in list(self._version_counts.items())},
                            route_keys=self.route_keys.snapshot())

    def result_received(self, base: str, queue_ms: float, batch_size: int) -> None:
        children = self._result_children.get(base)
        if children is None:
            children = (self.queue_wait_seconds.labels(base), self.batch_size.labels(base))
            self._result_children[base] = children
        children[0].observe(queue_ms / 1000.0)
        children[1].observe(batch_size)

    def published(self, base: str, n: int) -> None:
        self.published_total[base] = self.published_total.get(base, 0) + n  # the shadow's arrival rate (issue 25)
        child = self._published_children.get(base)
        if child is None:
            child = self._published_children[base] = self.tasks_published.labels(base)
        child.inc(n)

    def watch_queue(self, bases: Any, backlog: Callable[[str], float],
                    rate: Callable[[str], float | None]) -> None:
        """Backlog and service rate per base, read at scrape time."""
        for base in bases:
            self.backlog.labels(base).set_function(lambda b=base: backlog(b))
            self.service_rate.labels(base).set_function(lambda b=base: -1.0 if (v := rate(b)) is None else v)

    def watch_lag(self, bases: Any, lag: Callable[[str], float]) -> None:
        """Consumer lag per base, read at scrape time from the queue monitor's last read."""
        for base in bases:
            self.consumer_lag.labels(base, consumer_name(base)).set_function(lambda b=base: lag(b))

    def refused(self, base: str) -> None:
        self.refused_requests.labels(base).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

