"""The agent benchmark: a fleet of small models behind one agent, four ways to serve it on the same workers.

Each scenario (bench/scenarios/*.yaml, see fleet_scenario.py) is an agent whose documents each run a DAG
of calls to nine models; the document mix shifts between phases and comes in bursts. Every contender
gets the same N workers (the real sidecar with the `synthetic` runtime, whose batch costs a + b·n ms
as calibrated from the real models) and the same seeded trace:

- dedicated: one Deployment per model. Each model gets its own replicas, split in proportion to its mean
  load with hindsight (at least one each), and its own power-of-two-choices balancer on load polled
  every 50 ms (what one Service per model with a least-request balancer gives).
- dedicated_autoscaler: the same, but replicas move between models on a polled metric, as HPA/KEDA do:
  every `sync_s` (HPA's 15 s sync, scaled by the scenario's time scale) the desired replicas per model
  are ceil(outstanding / target); a model above its replicas takes one from a model whose desired count
  stayed below its own for the scale-down window (HPA's 300 s, scaled). A move drains the replica, stops
  the process and starts one for the other model: a pod's cold start, process and load.
- router: top-down routing to the workers that hold a model, on a polled view (50 ms) of each worker's
  queue depth, as the Gateway API inference extension's endpoint picker does. What each worker holds is
  the best static packing with hindsight within its memory (fleet_scenario.router_packing).
- lorafleet: one shared queue per model; workers pull and batch for themselves and place bases by queue
  pressure within their memory budget (sidecar/placement.py).

Measured per contender: documents/s within the SLO (p99 of the whole DAG), saturation (documents/s at an
overload point), the workers it needs to hold a target rate, and placements (moves) per minute.

    python -m lorafleet.bench.fleet [--scenario FILE ...] [--out FILE] [--quick] [--contenders a,b]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import yaml

from lorafleet.bench import fleet_scenario as fs
from lorafleet.bench.common import (
    RESULTS_DIR,
    exit_on_sigterm,
    loadavg,
    machine_info,
    say,
    spawn,
    stamp,
    stop_all,
    write_json,
)
from lorafleet.bench.routing import INBOX, Driver
from lorafleet.core.config import BaseModelSpec, FleetConfig, QueueConfig, ServingProfile, WorkerConfig
from lorafleet.core.wire import HDR_MSG_ID, Result, Task, consumer_name, work_subject
from lorafleet.nats.server import NatsServer
from lorafleet.tune.loadgen import LoadResult, open_loop_calls

CONTENDERS = ("lorafleet", "dedicated", "dedicated_autoscaler", "router")
POLL_S = 0.05  # the balancers' and the router's view of load
HPA_SYNC_S, HPA_SCALE_DOWN_S = 15.0, 300.0  # Kubernetes HPA defaults, multiplied by the time scale
TIME_SCALE = 0.1  # the benchmark runs a minute where a deployment lives hours: controllers run 10× faster
DEADLINE_S = 30.0


def private(model: str, worker: str) -> str:
    return f"{model}--{worker}"


class Pool:
    """The worker processes of one contender; `holds[w]` is what worker w serves (private queues unless shared)."""

    def __init__(self, sc: fs.Scenario, contender: str, n: int, nats_url: str, work: Path, queue: QueueConfig,
                 holds: dict[str, list[str]]) -> None:
        self.sc, self.contender, self.nats_url, self.work, self.queue = sc, contender, nats_url, work, queue
        self.names = [f"w{i + 1}" for i in range(n)]
        self.shared = contender == "lorafleet"
        self.holds = holds
        self.procs: dict[str, Any] = {}
        self.ready: set[str] = set(self.names)
        self.moves = 0
        bases = list(sc.models) if self.shared else [private(m, w) for w in self.names for m in sc.models]
        profile = ServingProfile(max_batch_ms=round(0.4 * sc.slo_ms, 1))
        worker = WorkerConfig(profile=profile, device="cpu", heartbeat_s=0.5)
        fleet = FleetConfig(nats_url=nats_url, bases=[self.spec(b) for b in bases], queue=queue, worker=worker)
        data = fleet.model_dump(mode="json", exclude_none=True)
        if self.shared:
            data["worker"]["memory_mb"] = sc.worker_memory_mb
            data["worker"]["placement"] = {"enabled": True, "wait_ms": 0.1 * sc.slo_ms, "idle_s": 0.25 * sc.seconds,
                                           "min_residency_s": 2.0, "check_ms": 100.0}
        self.fleet_file = work / f"fleet-{sc.name}-{contender}.yaml"
        self.fleet_file.write_text(yaml.safe_dump(data, sort_keys=False))

    def spec(self, base: str) -> BaseModelSpec:
        c = self.sc.models[base.split("--", 1)[0]]
        opts = {"a_ms": c.a_ms, "b_ms": c.b_ms, "load_ms": c.load_ms, "max_batch": c.max_batch}
        extra = {"memory_mb": c.memory_mb} if self.shared else {}
        return BaseModelSpec(name=base, runtime="synthetic", options=opts, **extra)

    def start(self, worker: str | None = None) -> None:
        for w in [worker] if worker else self.names:
            argv = [sys.executable, "-m", "lorafleet.sidecar", "--fleet", str(self.fleet_file),
                    "--nats-url", self.nats_url, "--worker-id", w, "--log-level", "WARNING"]
            for m in self.holds.get(w, []):
                argv += ["--base", m if self.shared else private(m, w)]
            self.procs[w] = spawn(argv, self.work / f"{self.sc.name}-{self.contender}-{w}.log", {})

    def stop(self, worker: str | None = None) -> None:
        procs = [self.procs.pop(worker)] if worker else list(self.procs.values())
        stop_all(procs, timeout=10.0)
        if worker is None:
            self.procs.clear()

    def check_alive(self) -> None:
        for w, p in self.procs.items():
            if p.poll() is not None:
                log = self.work / f"{self.sc.name}-{self.contender}-{w}.log"
                tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
                raise RuntimeError(f"worker {w} exited with code {p.returncode}:\n{tail}")

    def holders(self, model: str) -> list[str]:
        return [w for w in self.names if model in self.holds.get(w, []) and w in self.ready]


class Balancer:
    """Where a call goes: the shared subject (lorafleet) or one holder's private queue, by P2C on a polled view."""

    def __init__(self, pool: Pool, js: Any, seed: int) -> None:
        self.pool, self.js = pool, js
        self.rng = random.Random(seed)
        self.depth: dict[tuple[str, str], int] = {}  # (worker, model) → queued + held, polled
        self._task: asyncio.Task[None] | None = None

    def base_for(self, model: str) -> str | None:
        if self.pool.shared:
            return model
        holders = self.pool.holders(model)
        if not holders:
            return None
        if self.pool.contender == "router":  # the endpoint picker weighs a worker's whole queue
            def load(w: str) -> int:
                return sum(v for (x, _), v in self.depth.items() if x == w)
        else:  # one balancer per model sees only its own replicas' queues
            def load(w: str) -> int:
                return self.depth.get((w, model), 0)
        a, b = self.rng.sample(holders, 2) if len(holders) > 1 else (holders[0], holders[0])
        return private(model, a if load(a) <= load(b) else b)

    async def start(self) -> None:
        if not self.pool.shared:
            self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _poll(self) -> None:
        while True:
            keys = [(w, m) for w in self.pool.names for m in self.pool.holds.get(w, [])]
            infos = await asyncio.gather(*(self.js.consumer_info(self.pool.queue.stream,
                                                                 consumer_name(private(m, w))) for w, m in keys),
                                         return_exceptions=True)
            self.depth = {k: (i.num_pending or 0) + (i.num_ack_pending or 0) for k, i in zip(keys, infos, strict=True)
                          if not isinstance(i, BaseException)}
            await asyncio.sleep(POLL_S)


class Autoscaler:
    """HPA-like: replicas per model from outstanding work, moved one at a time with a cold start."""

    def __init__(self, pool: Pool, balancer: Balancer, driver: Driver, target: float) -> None:
        self.pool, self.balancer, self.driver, self.target = pool, balancer, driver, target
        self.below_since: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(HPA_SYNC_S * TIME_SCALE)
            await self._step(time.monotonic())

    async def _step(self, now: float) -> None:
        replicas = {m: len(self.pool.holders(m)) for m in self.pool.sc.models}
        outstanding = {m: sum(v for (_, x), v in self.balancer.depth.items() if x == m) for m in replicas}
        desired = {m: max(1, math.ceil(outstanding[m] / self.target)) for m in replicas}
        for m in replicas:
            if desired[m] < replicas[m]:
                self.below_since.setdefault(m, now)
            else:
                self.below_since.pop(m, None)
        up = [m for m in replicas if desired[m] > replicas[m]]
        down = [m for m, t in self.below_since.items()
                if now - t >= HPA_SCALE_DOWN_S * TIME_SCALE and replicas[m] > 1]
        if not up or not down:
            return
        to = max(up, key=lambda m: desired[m] - replicas[m])
        frm = min(down, key=lambda m: outstanding[m] / replicas[m])
        await self._move(frm, to)
        self.below_since.pop(frm, None)

    async def _move(self, frm: str, to: str) -> None:
        w = self.pool.holders(frm)[-1]
        self.pool.holds[w] = []  # the balancer stops sending to it, then its queue drains
        js, stream = self.balancer.js, self.pool.queue.stream
        for _ in range(int(DEADLINE_S / POLL_S)):
            with contextlib.suppress(Exception):
                info = await js.consumer_info(stream, consumer_name(private(frm, w)))
                if not (info.num_pending or info.num_ack_pending):
                    break
            await asyncio.sleep(POLL_S)
        await asyncio.to_thread(self.pool.stop, w)
        started = time.monotonic()
        self.pool.holds[w] = [to]
        self.pool.start(w)
        self.pool.ready.discard(w)  # a new pod gets traffic once it is ready: its first heartbeat
        while self.driver.heartbeats.get(w, 0.0) <= started:
            await asyncio.sleep(POLL_S)
        self.pool.ready.add(w)
        self.pool.moves += 1


async def run_point(driver: Driver, balancer: Balancer, sc: fs.Scenario, rate: float, seed: int,
                    tag: str) -> LoadResult:
    arrivals = fs.trace(sc, rate, seed)
    loop = asyncio.get_running_loop()
    counter = iter(range(10**9))

    async def one_call(model: str) -> bool:
        base = balancer.base_for(model)
        if base is None:
            return False  # no replica holds the model: the request fails at once
        tid = f"{tag}-{next(counter)}"
        fut: asyncio.Future[Result] = loop.create_future()
        driver.futures[tid] = fut
        now = time.time()
        task = Task(id=tid, request_id=tid, index=0, model=model, base=base, text="x", tokens=4,
                    deadline=now + DEADLINE_S, reply=f"{INBOX}.{tid}", enqueued=now)
        try:
            await driver.js.publish(work_subject(base), task.to_wire(), headers={HDR_MSG_ID: tid}, timeout=5.0)
            return (await asyncio.wait_for(fut, DEADLINE_S)).ok
        finally:
            driver.futures.pop(tid, None)

    async def document(i: int) -> bool:
        for stage in sc.documents[arrivals[i].doc]:
            oks = await asyncio.gather(*(one_call(m) for m, n in stage.items() for _ in range(n)))
            if not all(oks):
                return False
        return True

    return await open_loop_calls(document, [a.t for a in arrivals], level=rate, duration_s=sc.seconds,
                                 drain_s=DEADLINE_S)


def summary(r: LoadResult, slo_ms: float) -> dict[str, Any]:
    s = r.summary()
    p99 = r.percentile(99)
    s["meets_slo"] = bool(r.ok and r.errors == 0 and p99 is not None and p99 <= slo_ms)
    return s


async def run_contender(sc: fs.Scenario, contender: str, n: int, nats_url: str, work: Path, queue: QueueConfig,
                        rates: list[float], seed: int, on_point: Callable[[str, float, dict[str, Any]], None]
                        ) -> dict[str, Any]:
    """One contender on `n` workers over the rate ladder (stops at the first rate over the SLO)."""
    holds = initial_holds(sc, contender, n)
    if contender == "lorafleet" and "placement" not in WorkerConfig.model_fields:
        return {"feasible": False, "why": "this lorafleet's workers do not place bases yet (worker.placement)"}
    if holds is None:
        return {"feasible": False, "why": f"{n} workers cannot give each of {len(sc.models)} models a replica"}
    pool = Pool(sc, contender, n, nats_url, work, queue, holds)
    nc = await nats.connect(nats_url, max_reconnect_attempts=3)
    driver = Driver(nc, queue)
    await driver.start()
    balancer = Balancer(pool, driver.js, seed)
    scaler = Autoscaler(pool, balancer, driver, target=4.0) if contender == "dedicated_autoscaler" else None
    pool.start()
    points: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        await driver.wait_workers(pool, timeout=180)
        await balancer.start()
        if scaler is not None:
            scaler.start()
        for k, rate in enumerate(rates):
            r = await run_point(driver, balancer, sc, rate, seed + k, f"{sc.name}-{contender}-{n}-{k}")
            s = summary(r, sc.slo_ms)
            s["purged_after"] = await driver.settle()
            points.append(s)
            on_point(contender, rate, s)
            if not s["meets_slo"] and k < len(rates) - 1:
                break
            pool.check_alive()
    finally:
        if scaler is not None:
            await scaler.stop()
        await balancer.stop()
        pool.stop()
        await driver.settle(timeout=2.0)
        await nc.drain()
    minutes = (time.monotonic() - t0) / 60.0
    ok = [p["level"] for p in points if p["meets_slo"]]
    return {"feasible": True, "workers": n, "points": points,
            "rate_within_slo": max(ok) if ok else None,
            "saturation": round(max(p["throughput_rps"] for p in points), 3) if points else None,
            "placements_per_min": round(pool.moves / minutes, 2) if minutes else 0.0}


def initial_holds(sc: fs.Scenario, contender: str, n: int) -> dict[str, list[str]] | None:
    names = [f"w{i + 1}" for i in range(n)]
    if contender == "lorafleet":
        return {}  # nothing pinned: placement decides
    if contender == "router":
        packing = fs.router_packing(sc, n)
        return None if packing is None else dict(zip(names, packing, strict=True))
    split = fs.dedicated_split(sc, n)
    if split is None:
        return None
    it = iter(names)
    return {next(it): [m] for m, k in split.items() for _ in range(k)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lorafleet.bench.fleet", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", type=Path, action="append", help="a scenario file (repeatable; default: every "
                   "file in bench/scenarios/)")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated subset of {CONTENDERS}")
    p.add_argument("--quick", action="store_true", help="two rates, half-length phases: a smoke run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "fleet.json")
    args = p.parse_args(argv)
    contenders = args.contenders.split(",")
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        p.error(f"unknown contender(s) {unknown}; choose from {', '.join(CONTENDERS)}")
    exit_on_sigterm()
    files = args.scenario or fs.default_files()
    info = machine_info()
    say(f"bench/fleet on {info['cpu']} ({info['cpus']} CPUs), load average {info['loadavg_start']}")
    results: dict[str, Any] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-fleet-") as tmp:
        work = Path(tmp)
        server = NatsServer(work / "nats").start()
        try:
            for f in files:
                sc = fs.load(f)
                if args.quick:
                    sc = sc.model_copy(update={"phases": [ph.model_copy(update={"seconds": ph.seconds / 2})
                                                          for ph in sc.phases]})
                cap = sc.capacity_docs_per_s()
                fractions = [0.3, 0.6] if args.quick else sc.rate_fractions
                rates = [round(x * cap, 2) for x in fractions] + [round(1.3 * cap, 2)]
                say(f"  {sc.name}: {len(sc.models)} models, {sc.workers} workers, capacity {cap:.1f} docs/s, "
                    f"SLO p99 ≤ {sc.slo_ms:g} ms")

                def on_point(c: str, rate: float, s: dict[str, Any]) -> None:
                    say(f"    {c:<21} {rate:6.2f} docs/s → {s['throughput_rps']:6.2f}/s  p99 {s['p99_ms']} ms  "
                        f"errors {s['errors']}  {'ok' if s['meets_slo'] else 'over SLO'}")

                queue = QueueConfig(storage="memory")
                out = {c: asyncio.run(run_contender(sc, c, sc.workers, server.url, work, queue, rates, args.seed,
                                                    on_point)) for c in contenders}
                results[sc.name] = {"description": sc.description, "capacity_docs_per_s": round(cap, 2),
                                    "slo_p99_ms": sc.slo_ms, "workers": sc.workers, "contenders": out}
        finally:
            server.stop()
    result = {"benchmark": "fleet", "when": stamp(), "cpu": info["cpu"], "machine": {**info, "loadavg_end": loadavg()},
              "time_scale": TIME_SCALE, "scenarios": results, "wall_s": round(time.monotonic() - t0, 1)}
    write_json(args.out, result)
    say(f"wrote {args.out} ({result['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
