"""The adapter benchmark's load side: one local cluster, a driver that plays the gateway, open-loop ladders.

The driver is bench/routing.py's (JetStream publish with Nats-Msg-Id, results on a core-NATS inbox):
each task names its adapter id and a URI under the workers' `adapter_roots`, so 1,000 adapters need
no fleet entries and no gateway work per request (two shared cores: the gateway's HTTP and JSON would
be measured instead of the worker). Arrivals come from lorafleet.tune.loadgen (Poisson, latency from
the intended send time), and workers report the adapters they hold in their heartbeats, which is how
the warm-up knows every adapter is hot on every worker.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats

from lorafleet.bench.common import fmt, say
from lorafleet.bench.routing import INBOX, Driver, point_summary
from lorafleet.core import heartbeats
from lorafleet.core.config import BaseModelSpec, FleetConfig, GatewayConfig, QueueConfig, ServingProfile, WorkerConfig
from lorafleet.core.wire import HDR_MSG_ID, Heartbeat, Result, Task, work_subject
from lorafleet.ops.cluster import LocalCluster
from lorafleet.ops.processes import stop_group
from lorafleet.tune.loadgen import LoadResult, open_loop_calls, poisson_schedule

BASE = "minilm"
DEADLINE_S = 30.0
WARM_CHUNK = 16  # adapters warmed at once: a worker holding many tasks of cold adapters must not outlast ack_wait
SLO_RETRIES = 1  # a rate over the SLO runs once more before the ladder stops (one hiccup of a shared machine)


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def adapter_trace(n: int, traffic: str, count: int, seed: int, zipf_s: float) -> list[int | None]:
    """Adapter index per arrival (None: the bare base); a seeded shuffle so a Zipf head is not adapter 0 only."""
    rng = random.Random(seed)
    if n == 0:
        return [None] * count
    order = list(range(n))
    rng.shuffle(order)
    weights = zipf_weights(n, zipf_s) if traffic == "zipf" else [1.0] * n
    return list(rng.choices(order, weights, k=count))


def fleet_for(model_source: str, profile: dict[str, Any], adapter_root: Path, queue: QueueConfig,
              max_adapters: int = 1024, device: str = "cpu", runtime: str | None = None) -> FleetConfig:
    """One base, the profile under test worker-wide, adapters allowed from the benchmark's cache folder."""
    spec = BaseModelSpec(name=BASE, source=model_source, **({"runtime": runtime} if runtime else {}))
    return FleetConfig(bases=[spec], queue=queue,
                       gateway=GatewayConfig(port=0, default_deadline_s=DEADLINE_S),
                       worker=WorkerConfig(profile=ServingProfile(**profile), device=device, heartbeat_s=0.5,
                                           max_adapters=max_adapters, adapter_roots=[str(adapter_root)]))


@dataclass
class Point:
    rate: float
    seconds: float
    seed: int


class Bench:
    """A running cluster (NATS + gateway + workers), the driver connected as admin, and heartbeats seen."""

    def __init__(self, cluster: LocalCluster, texts: list[str], adapters: list[Path]) -> None:
        self.cluster, self.texts, self.adapters = cluster, texts, adapters
        self.ids = [p.name for p in adapters]
        self.hb: dict[str, Heartbeat] = {}
        self.nc: Any = None
        self.driver: Driver | None = None
        self.workers = 1
        self._n = 0

    async def connect(self) -> None:
        self.nc = await nats.connect(self.cluster.nats_url, max_reconnect_attempts=5,
                                     **self.cluster.client_options("admin"))
        self.driver = Driver(self.nc, self.cluster.fleet.queue)
        await self.driver.start()
        await heartbeats.subscribe(self.nc, self._on_hb)

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.drain()

    def _on_hb(self, hb: Heartbeat) -> None:
        self.hb[hb.worker] = hb

    def worker_names(self) -> list[str]:
        return [f"worker-{i + 1}" for i in range(self.workers)]

    def worker_pid(self, name: str = "worker-1") -> int:
        return self.cluster.pid(name)

    async def set_workers(self, fleet: FleetConfig, workers: int, timeout: float = 240.0) -> float:
        """Restart worker-1 with `fleet`'s profile, start or stop worker-2…; wait for a heartbeat from each new pid."""
        t0 = time.monotonic()
        await asyncio.to_thread(self.cluster.restart_worker, "worker-1", fleet)
        for i in range(2, max(workers, self.workers) + 1):
            name = f"worker-{i}"
            proc = self.cluster.procs.pop(name, None)
            if proc is not None:
                await asyncio.to_thread(stop_group, proc.pid, 10.0, name)
            if i <= workers:
                await asyncio.to_thread(self.cluster.start_worker, name)
        self.workers = workers
        self.hb.clear()
        pids = {n: self.worker_pid(n) for n in self.worker_names()}
        deadline = time.monotonic() + timeout
        while not all(n in self.hb and self.hb[n].pid == pid for n, pid in pids.items()):
            for n in pids:
                if self.cluster.procs[n].poll() is not None:
                    raise RuntimeError(f"{n} exited; see {self.cluster.log_path(n)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers {list(pids)} not ready within {timeout:.0f}s")
            await asyncio.sleep(0.1)
        return time.monotonic() - t0

    # -- one request -----------------------------------------------------------------------

    async def call(self, adapter: int | None, i: int, deadline_s: float = DEADLINE_S) -> bool:
        """Publish one task and wait for its result; True when it succeeded."""
        assert self.driver is not None
        self._n += 1
        tid = f"a{self._n}-{int(time.time() * 1000) % 10**8}"
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self.driver.futures[tid] = fut
        now = time.time()
        aid = self.ids[adapter] if adapter is not None else None
        task = Task(id=tid, request_id=tid, index=0, model=aid or BASE, base=BASE, text=self.texts[i % len(self.texts)],
                    tokens=32, deadline=now + deadline_s, reply=f"{INBOX}.{tid}", enqueued=now, adapter=aid,
                    adapter_uri=str(self.adapters[adapter]) if adapter is not None else None)
        try:
            await self.driver.js.publish(work_subject(BASE), task.to_wire(), headers={HDR_MSG_ID: tid}, timeout=5.0)
            result = await asyncio.wait_for(fut, deadline_s)
            return result.ok
        finally:
            self.driver.futures.pop(tid, None)

    async def timed_call(self, adapter: int | None, i: int = 0) -> float:
        """Latency in ms of one request alone; raises if it failed."""
        t0 = time.perf_counter()
        if not await self.call(adapter, i, deadline_s=120.0):
            raise RuntimeError(f"request to adapter {adapter} failed")
        return (time.perf_counter() - t0) * 1000.0

    # -- warm-up ---------------------------------------------------------------------------

    def hot_everywhere(self, n: int) -> set[int]:
        """Indices < n that every current worker reports loaded."""
        names = self.worker_names()
        held = [set(self.hb[w].adapters.get(BASE, [])) if w in self.hb else set() for w in names]
        return {k for k in range(n) if all(self.ids[k] in h for h in held)}

    async def warm(self, n: int, max_rounds: int = 30) -> dict[str, Any]:
        """Requests to adapters 0…n-1 until every worker's heartbeat lists all of them (loaded, hot)."""
        t0 = time.monotonic()
        sent = rounds = 0
        while rounds < max_rounds:
            missing = [k for k in range(n) if k not in self.hot_everywhere(n)]
            if not missing:
                break
            rounds += 1
            for c in range(0, len(missing), WARM_CHUNK):
                chunk = missing[c:c + WARM_CHUNK]
                await asyncio.gather(*(self.call(k, k, deadline_s=300.0) for k in chunk for _ in range(self.workers)))
                sent += len(chunk) * self.workers
            await self._next_heartbeats()
        left = n - len(self.hot_everywhere(n))
        return {"adapters": n, "seconds": round(time.monotonic() - t0, 1), "requests": sent, "rounds": rounds,
                "not_hot": left}

    async def _next_heartbeats(self, timeout: float = 5.0) -> None:
        seen = {w: hb.ts for w, hb in self.hb.items()}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(
                w in self.hb and self.hb[w].ts > seen.get(w, 0.0) for w in self.worker_names()):
            await asyncio.sleep(0.05)

    # -- open loop -------------------------------------------------------------------------

    async def run_point(self, n: int, traffic: str, p: Point, zipf_s: float) -> LoadResult:
        schedule = poisson_schedule(p.rate, p.seconds, p.seed)
        trace = adapter_trace(n, traffic, len(schedule), p.seed + 1, zipf_s)

        async def call(i: int) -> bool:
            return await self.call(trace[i], i)

        return await open_loop_calls(call, schedule, level=p.rate, duration_s=p.seconds, drain_s=DEADLINE_S)

    async def settle(self) -> int:
        assert self.driver is not None
        return await self.driver.settle()

    async def ladder(self, n: int, traffic: str, rates: list[float], overload_cap: float, point_s: float,
                     slo_ms: float, seed: int, zipf_s: float, label: str) -> dict[str, Any]:
        """Rising rates until p99 exceeds the SLO (retried once), then overload points for saturation throughput.

        The overload rate is 1.5× the first rate over the SLO (at most `overload_cap`): enough to saturate,
        without a backlog that takes a slow contender half a minute to drain. An overload point's throughput
        counts completions over its send window plus the drain, so it is what the workers sustain; if the
        workers kept up with it anyway (not saturated), it runs once more at twice the rate.
        """
        points: list[dict[str, Any]] = []
        slo_rate: float | None = None
        k = 0
        for k, rate in enumerate(rates):
            tries: list[dict[str, Any]] = []
            for _ in range(1 + SLO_RETRIES):
                r = await self.run_point(n, traffic, Point(rate, point_s, seed + k), zipf_s)
                tries.append(point_summary(r, slo_ms))
                await self.settle()
                if tries[-1]["meets_slo"]:
                    break
            s = min(tries, key=lambda t: (not t["meets_slo"], t["p99_ms"] if t["p99_ms"] is not None else 1e18))
            if len(tries) > 1:
                s["tries_p99_ms"] = [t["p99_ms"] for t in tries]
            s["overload"] = False
            points.append(s)
            self._say(label, rate, s, "")
            if not s["meets_slo"]:
                break
            slo_rate = rate
        over = min(overload_cap, 1.5 * rates[k]) if slo_rate != rates[-1] else overload_cap
        for attempt in range(2):
            r = await self.run_point(n, traffic, Point(round(over, 1), 2 * point_s, seed + 100 + attempt), zipf_s)
            s = point_summary(r, slo_ms)
            s["overload"] = True
            # Saturated: the workers fell behind the offered rate (completions lag arrivals by over 10 %).
            s["saturated"] = bool(s["throughput_rps"] < 0.9 * over)
            points.append(s)
            await self.settle()
            self._say(label, over, s, "(overload)")
            if s["saturated"]:
                break
            over *= 2
        sat = max(points, key=lambda p: p["throughput_rps"])
        return {"max_rate_within_slo": slo_rate, "saturation_rps": round(sat["throughput_rps"], 2),
                "saturated": any(p.get("saturated") for p in points), "points": points}

    @staticmethod
    def _say(label: str, rate: float, s: dict[str, Any], tag: str) -> None:
        say(f"    {label:<26} {rate:6.1f}/s {tag:<10} → {s['throughput_rps']:6.1f}/s  p50 {fmt(s['p50_ms'])}  "
            f"p99 {fmt(s['p99_ms'])} ms  errors {s['errors']}  {'ok' if s['meets_slo'] else 'over SLO'}")
