"""Heartbeats and presence: what `lorafleet status`, gateways, promote and benchmarks hear of the fleet.

Worker heartbeats say which workers are alive and what they hold; they are never used for routing
(workers pull). Presence is smaller and said by every process (workers and gateways): role, host, pid,
state and how often its supervisor restarted it (`LORAFLEET_RESTARTS`), every `PRESENCE_EVERY_S` on
`lorafleet.presence.<role>.<name>`, so `lorafleet status` shows a whole cluster from any host that
can reach NATS, without a local file. A malformed message is dropped quietly: a stray message must
not break a listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from lorafleet.core.wire import HEARTBEAT_PREFIX, PRESENCE_PREFIX, Heartbeat, WireError, pack, presence_subject, unpack

log = logging.getLogger(__name__)

HEARTBEAT_SUBJECT = f"{HEARTBEAT_PREFIX}.>"
PRESENCE_SUBJECT = f"{PRESENCE_PREFIX}.>"
PRESENCE_EVERY_S = 1.0  # fixed, so a listener knows how long to listen whatever the fleet file says
ENV_RESTARTS = "LORAFLEET_RESTARTS"  # set by the local supervisor on a part it restarted


async def subscribe(nc: Any, on_heartbeat: Callable[[Heartbeat], None]) -> Any:
    """Call `on_heartbeat` (on the event loop) for every valid heartbeat; returns the subscription."""

    async def handler(msg: Any) -> None:
        try:
            hb = Heartbeat.from_wire(msg.data)
        except WireError:
            log.debug("ignoring a malformed heartbeat on %s", msg.subject)
            return
        on_heartbeat(hb)

    return await nc.subscribe(HEARTBEAT_SUBJECT, cb=handler)


async def collect(nc: Any, listen_s: float, *, until: Callable[[dict[str, Heartbeat]], bool] | None = None
                  ) -> dict[str, Heartbeat]:
    """The latest heartbeat of every worker heard within `listen_s` (earlier once `until(seen)` holds)."""
    seen: dict[str, Heartbeat] = {}
    done = asyncio.Event()

    def on_hb(hb: Heartbeat) -> None:
        seen[hb.worker] = hb
        if until is not None and until(seen):
            done.set()

    sub = await subscribe(nc, on_hb)
    try:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), listen_s)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return seen


@dataclass(frozen=True, slots=True)
class Presence:
    """One process of the fleet, as it describes itself."""

    role: str  # worker | gateway
    name: str  # worker id, gateway id
    host: str
    pid: int
    state: str  # worker: serving | draining; gateway: ready | not-ready
    restarts: int = 0
    started: float = 0.0  # epoch seconds
    ts: float = field(default_factory=time.time)

    def to_wire(self) -> bytes:
        return pack({"v": 1, "role": self.role, "name": self.name, "host": self.host, "pid": self.pid,
                     "state": self.state, "restarts": self.restarts, "started": self.started, "ts": self.ts})

    @classmethod
    def from_wire(cls, data: bytes) -> Presence:
        try:
            d = unpack(data)
        except Exception as exc:
            raise WireError(f"presence is not MessagePack: {exc}") from exc
        if not isinstance(d, dict):
            raise WireError("presence body is not a map")
        try:
            out = cls(str(d["role"]), str(d["name"]), str(d["host"]), int(d["pid"]), str(d["state"]),
                      int(d.get("restarts", 0)), float(d.get("started", 0.0)), float(d.get("ts", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"presence field missing or of the wrong type: {exc}") from exc
        return out


def restarts_from_env() -> int:
    try:
        return max(int(os.environ.get(ENV_RESTARTS, "0")), 0)
    except ValueError:
        return 0


class Beacon:
    """Publishes this process's `Presence` every `PRESENCE_EVERY_S` on the event loop, until `stop()`.

    `state()` may be a plain function or a coroutine function; a failed publish (reconnecting) is skipped.
    """

    def __init__(self, nc: Any, role: str, name: str, state: Callable[[], str | Awaitable[str]],
                 every_s: float = PRESENCE_EVERY_S, stats: Callable[[], GatewayStats | None] | None = None) -> None:
        self.nc, self.role, self.name, self.state, self.every_s = nc, role, name, state, every_s
        self.stats = stats  # a gateway's per-version counters, published with its presence (issue 25)
        self.subject = presence_subject(role, name)
        self.host, self.pid, self.restarts = socket.gethostname(), os.getpid(), restarts_from_env()
        self.started = time.time()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"lorafleet-presence-{self.role}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def publish(self) -> None:
        state = self.state()
        if inspect.isawaitable(state):
            state = await state
        p = Presence(self.role, self.name, self.host, self.pid, str(state), self.restarts, self.started)
        await self.nc.publish(self.subject, p.to_wire())
        stats = self.stats() if self.stats is not None else None
        if stats is not None:
            await self.nc.publish(stats_subject(self.name), stats.to_wire())

    async def _run(self) -> None:
        while True:
            try:
                await self.publish()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("presence publish failed: %r", exc)
            await asyncio.sleep(self.every_s)


async def collect_presence(nc: Any, listen_s: float = PRESENCE_EVERY_S * 1.5) -> dict[str, Presence]:
    """The latest presence of every process heard within `listen_s`, keyed `role/name`."""
    seen: dict[str, Presence] = {}

    async def handler(msg: Any) -> None:
        try:
            p = Presence.from_wire(msg.data)
        except WireError:
            log.debug("ignoring a malformed presence on %s", msg.subject)
            return
        seen[f"{p.role}/{p.name}"] = p

    sub = await nc.subscribe(PRESENCE_SUBJECT, cb=handler)
    try:
        await asyncio.sleep(listen_s)  # listening is the point: every process speaks once per PRESENCE_EVERY_S
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return seen


# Per-version figures (issue 25, `promote --canary P --watch`): every gateway publishes, with its presence, its
# cumulative counters per (served name, registry version) on `lorafleet.stats.gateway.<id>`; a watcher sums the
# deltas over all gateways, so it judges the whole fleet's traffic, not one gateway's view.
STATS_PREFIX = "lorafleet.stats"
STATS_SUBJECT = f"{STATS_PREFIX}.gateway.>"
# Fixed latency buckets (upper bounds, seconds; the last count is everything above): the same on every gateway,
# so counts add up across gateways and p99 comes from summed deltas.
STATS_BUCKETS: tuple[float, ...] = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                                    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


def stats_subject(gateway_id: str) -> str:
    return f"{STATS_PREFIX}.gateway.{gateway_id}"


@dataclass(frozen=True, slots=True)
class VersionCounts:
    """Requests of one (name, version) as counted by one gateway (or summed): errors are 5xx answers (worker
    failures included); `buckets` has len(STATS_BUCKETS) + 1 latency counts, the last one above every bound."""

    requests: int = 0
    errors: int = 0
    buckets: tuple[int, ...] = (0,) * (len(STATS_BUCKETS) + 1)
    empty: int = 0  # generative answers with no text (stopped or cut at max_tokens before any): `--watch` compares

    def __add__(self, other: VersionCounts) -> VersionCounts:
        return VersionCounts(self.requests + other.requests, self.errors + other.errors,
                             tuple(a + b for a, b in zip(self.buckets, other.buckets, strict=True)),
                             self.empty + other.empty)

    def __sub__(self, other: VersionCounts) -> VersionCounts:
        return VersionCounts(self.requests - other.requests, self.errors - other.errors,
                             tuple(a - b for a, b in zip(self.buckets, other.buckets, strict=True)),
                             self.empty - other.empty)

    def lower_than(self, other: VersionCounts) -> bool:
        """A counter went down: the gateway restarted (its counters start again at 0)."""
        return self.requests < other.requests or self.errors < other.errors or self.empty < other.empty or any(
            a < b for a, b in zip(self.buckets, other.buckets, strict=True))

    @property
    def empty_rate(self) -> float:
        """Empty answers per successful answer."""
        ok = self.requests - self.errors
        return self.empty / ok if ok > 0 else 0.0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding the q-quantile (inf when it lies above the last bound; 0.0
        without requests): conservative, like Prometheus' histogram_quantile without interpolation."""
        total = sum(self.buckets)
        if total <= 0:
            return 0.0
        rank, seen = q * total, 0
        for i, n in enumerate(self.buckets):
            seen += n
            if seen >= rank and n > 0:
                return STATS_BUCKETS[i] if i < len(STATS_BUCKETS) else float("inf")
        return float("inf")


def bucket_index(seconds: float) -> int:
    for i, bound in enumerate(STATS_BUCKETS):
        if seconds <= bound:
            return i
    return len(STATS_BUCKETS)


@dataclass(frozen=True, slots=True)
class RouteKeys:
    """The requests to one name under a canary (keyed by its canary version) that a route key split, as one gateway
    counted them (issue 38: `status` warns when one key carries most of them). `top`: the busiest keys as
    (digest, source, count), source header | api-key | address; a digest of the key, never the key."""

    requests: int = 0
    keys: int = 0  # distinct keys seen (a gateway keeps at most a bounded number)
    top: tuple[tuple[str, str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class GatewayStats:
    """One gateway's cumulative per-version counters, keyed (name, version)."""

    gateway: str
    versions: dict[tuple[str, str], VersionCounts]
    ts: float = field(default_factory=time.time)
    route_keys: dict[tuple[str, str], RouteKeys] = field(default_factory=dict)  # (name, canary version) → keys

    def to_wire(self) -> bytes:
        return pack({"v": 1, "gateway": self.gateway, "ts": self.ts,
                     "versions": [[m, v, c.requests, c.errors, list(c.buckets), c.empty]
                                  for (m, v), c in sorted(self.versions.items())],
                     "route_keys": [[m, v, k.requests, k.keys, [list(t) for t in k.top]]
                                    for (m, v), k in sorted(self.route_keys.items())]})

    @classmethod
    def from_wire(cls, data: bytes) -> GatewayStats:
        try:
            d = unpack(data)
            versions = {(str(row[0]), str(row[1])): VersionCounts(  # an older gateway sends no empty count
                int(row[2]), int(row[3]), tuple(int(b) for b in row[4]), int(row[5]) if len(row) > 5 else 0)
                for row in d["versions"]}
            if any(len(c.buckets) != len(STATS_BUCKETS) + 1 for c in versions.values()):
                raise ValueError("latency buckets differ from STATS_BUCKETS")
            route_keys = {(str(row[0]), str(row[1])): RouteKeys(  # an older gateway sends none
                int(row[2]), int(row[3]), tuple((str(t[0]), str(t[1]), int(t[2])) for t in row[4]))
                for row in d.get("route_keys", ())}
            return cls(str(d["gateway"]), versions, float(d.get("ts", 0.0)), route_keys)
        except Exception as exc:
            raise WireError(f"gateway stats malformed: {exc}") from exc


async def subscribe_stats(nc: Any, on_stats: Callable[[GatewayStats], None]) -> Any:
    """Call `on_stats` for every valid gateway stats message; returns the subscription."""

    async def handler(msg: Any) -> None:
        try:
            stats = GatewayStats.from_wire(msg.data)
        except WireError:
            log.debug("ignoring malformed gateway stats on %s", msg.subject)
            return
        on_stats(stats)

    return await nc.subscribe(STATS_SUBJECT, cb=handler)
