"""Pull versus push: the same workers and the same seeded arrival trace under two dispatch policies (issue 6 §1).

- pull: lorafleet as it is. Every task goes to the shared JetStream subject of its model; the
  workers (the real sidecar) pull from one durable consumer per model and batch for themselves.
- push-stale: a router written for this benchmark. Each worker has a private queue per model
  (a base named MODEL--WORKER, served by the very same sidecar code), and the router assigns each
  task to one worker by **power of two choices**: two distinct workers drawn at random, the one with
  fewer outstanding tasks wins. Its view of load is polled every 50 ms from JetStream (tasks queued
  + held per worker's consumers), as production routers scrape worker metrics. P2C is the choice
  because least-outstanding on a 50 ms-old snapshot sends every task of the interval to one worker
  (herding); P2C is the robust standard for stale load (Envoy's least_request).
- push-fresh: the same P2C router on perfectly fresh load (its own exact count of tasks sent and
  not yet answered, per worker): the upper bound for push.

Workers run the real sidecar with the `synthetic` runtime plugin (bench/synth_worker.py), whose
batch of n tasks costs a + b·n ms (sleeping), so dispatch is measured and not the two cores; the `minilm` scenario runs
the real all-MiniLM-L6-v2 instead. The driver in this process plays the gateway (JetStream
publish with Nats-Msg-Id, reply on a core-NATS inbox) and drives open-loop arrivals with
lorafleet.tune.loadgen (Poisson, or bursts), timing each task from its intended send time.

Every policy's workers run the same profile, including the batch time budget (`max_batch_ms`,
by default 0.4 × the scenario's SLO): a worker cuts each pull to what it computes within it.

Metric per policy: the highest offered rate (on a ladder of fractions of the nominal capacity)
whose p99 stays within the scenario's SLO, and the throughput at saturation (an overload point).
A rate over the SLO is run once more on the same trace before the policy stops climbing.

The `replicated` scenario prices replication: pull on the `equal` workload and the same trace, once on one
nats-server (R1 file stream) and once on a 3-node JetStream cluster (R3 file stream, lorafleet.nats.cluster),
side by side, with the ratio R3/R1 of the rate within the SLO and of saturation throughput.

    python -m lorafleet.bench.routing [--quick] [--scenarios equal,slow,models,bursts,minilm,replicated]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import yaml

from lorafleet.bench.common import RESULTS_DIR, finish, fmt, german_sentences, machine_info, parser, run_head, say
from lorafleet.bench.processes import exit_on_sigterm, spawn, stop_all
from lorafleet.bench.synth_worker import SLOWDOWN_ENV, model_of
from lorafleet.core import heartbeats
from lorafleet.core.config import BaseModelSpec, FleetConfig, QueueConfig, ServingProfile, WorkerConfig
from lorafleet.core.wire import HDR_MSG_ID, Heartbeat, Result, Task, consumer_name, work_subject
from lorafleet.nats.auth import options_from_env
from lorafleet.nats.client import server_urls
from lorafleet.nats.cluster import NatsCluster
from lorafleet.nats.server import NatsServer
from lorafleet.tune.loadgen import LoadResult, open_loop_calls, poisson_schedule

POLICIES = ("pull", "push-stale", "push-fresh")
ALGORITHMS = {"p2c": "power of two choices (P2C) on outstanding tasks per worker",
              "lor": "least outstanding tasks over all workers (ties at random)"}
POLL_S = 0.05
SLO_RETRIES = 1  # a rate over the SLO is measured once more before a policy stops climbing
INBOX = "_INBOX.bench-routing"
MINILM = "minilm"
REPLICATED = "replicated"  # pull on one node (R1) against a 3-node cluster (R3), file streams


@dataclass
class Scenario:
    name: str
    description: str
    models: dict[str, tuple[float, float] | None]  # model → (a_ms, b_ms); None: the real MiniLM
    mix: dict[str, float]  # share of requests per model
    slowdowns: list[float]  # one per worker
    slo_ms: float
    bursts: bool = False
    heterogeneous: bool = False
    capacity_hint: float | None = None  # req/s, for models whose cost is not modelled (MiniLM)
    fractions: list[float] = field(default_factory=lambda: [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1])
    overload: float = 1.4  # the saturation point, as a fraction of nominal capacity

    def nominal_capacity(self, max_items: int) -> float:
        """Tasks/s when every worker runs full batches of the request mix (the modelled ceiling)."""
        if any(c is None for c in self.models.values()):
            assert self.capacity_hint is not None
            return self.capacity_hint
        per_task_s = sum(share * (c[0] + c[1] * max_items) / max_items / 1000.0  # type: ignore[index]
                         for m, share in self.mix.items() for c in [self.models[m]])
        return sum(1.0 / (per_task_s * s) for s in self.slowdowns)


def scenarios(slo_ms: float) -> dict[str, Scenario]:
    base = (30.0, 4.0)
    return {
        "equal": Scenario("equal", "3 equal workers, one model (30 + 4·n ms per batch)", {"m": base}, {"m": 1.0},
                          [1.0, 1.0, 1.0], slo_ms),
        "slow": Scenario("slow", "3 workers, one of them 3× slower", {"m": base}, {"m": 1.0}, [1.0, 1.0, 3.0], slo_ms,
                         heterogeneous=True),
        "models": Scenario("models", "3 base models of different cost (10+1·n, 30+4·n, 60+12·n ms) on 3 workers",
                           {"small": (10.0, 1.0), "mid": base, "large": (60.0, 12.0)},
                           {"small": 1 / 3, "mid": 1 / 3, "large": 1 / 3}, [1.0, 1.0, 1.0], slo_ms, heterogeneous=True),
        "bursts": Scenario("bursts", "3 equal workers; arrivals in bursts (2.5× the mean rate for 250 ms of every "
                           "second, 0.5× otherwise)", {"m": base}, {"m": 1.0}, [1.0, 1.0, 1.0], slo_ms, bursts=True),
        MINILM: Scenario(MINILM, "2 workers running the real all-MiniLM-L6-v2 (1 torch thread each), statute "
                         "sentences", {MINILM: None}, {MINILM: 1.0}, [1.0, 1.0], 2 * slo_ms,
                         fractions=[0.5, 0.65, 0.8, 0.9, 1.0, 1.1]),
    }


def measure_minilm_capacity(texts: list[str], workers: int = 2, seconds: float = 3.0) -> float:
    """Nominal capacity of the MiniLM scenario on this machine: `workers` × raw one-thread batch-32 encode.

    Measured rather than fixed, so that the rate ladder reaches saturation on fast and slow machines alike.
    """
    import torch
    from sentence_transformers import SentenceTransformer

    from lorafleet.bench.serve import measure_raw
    from lorafleet.core.model_source import resolve_model_source

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker runs
    try:
        model = SentenceTransformer(resolve_model_source("all-MiniLM-L6-v2"), device="cpu")
        raw = measure_raw(model, texts, [32], seconds)
    finally:
        torch.set_num_threads(threads)
    return workers * raw["best_sentences_per_s"]


BUDGET_SHARE_OF_SLO = 0.4  # a task may wait behind one batch and then run in its own: two budgets, plus queueing


def scenario_budget_ms(sc: Scenario, budget: float | str | None) -> float | None:
    """The workers' max_batch_ms in scenario `sc`: a fixed value, None (off), or the default share of its SLO."""
    if isinstance(budget, str):
        return round(BUDGET_SHARE_OF_SLO * sc.slo_ms, 1)
    return budget


def burst_schedule(rate: float, duration_s: float, seed: int) -> list[float]:
    """A Poisson process whose rate is 2.5× `rate` for the first 250 ms of each second, 0.5× after (mean: `rate`)."""
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while t < duration_s:
        hi = (t % 1.0) < 0.25
        r = rate * (2.5 if hi else 0.5)
        boundary = (int(t) + (0.25 if hi else 1.0))
        gap = rng.expovariate(r)
        if t + gap >= boundary:  # memoryless: restart the draw at the rate change
            t = boundary
            continue
        t += gap
        if t < duration_s:
            out.append(t)
    return out


# -- workers ------------------------------------------------------------------------------------

class Workers:
    """Worker processes for one policy: every worker serves every model, on shared or private queues."""

    def __init__(self, sc: Scenario, policy: str, nats_url: str, work: Path, profile: ServingProfile,
                 queue: QueueConfig) -> None:
        self.sc, self.policy, self.nats_url, self.work = sc, policy, nats_url, work
        self.names = [f"w{i + 1}" for i in range(len(sc.slowdowns))]
        self.stream = queue.stream
        self.private = policy != "pull"
        bases = [b for w in self.names for b in self.bases_of(w)] if self.private else list(sc.models)
        specs = [self.spec(b) for b in bases]
        fleet = FleetConfig(nats_url=nats_url, bases=specs, queue=queue,
                            worker=WorkerConfig(profile=profile, device="cpu", heartbeat_s=0.5))
        self.fleet_file = work / f"fleet-{sc.name}-{'push' if self.private else 'pull'}.yaml"
        self.fleet_file.write_text(yaml.safe_dump(fleet.model_dump(mode="json"), sort_keys=False))
        self.procs: dict[str, Any] = {}

    def spec(self, base: str) -> BaseModelSpec:
        """Synthetic models run the `synthetic` runtime plugin with their cost; the others the real MiniLM."""
        cost = self.sc.models[model_of(base)]
        if cost is None:
            return BaseModelSpec(name=base, source="all-MiniLM-L6-v2")
        return BaseModelSpec(name=base, runtime="synthetic", options={"a_ms": cost[0], "b_ms": cost[1]})

    def bases_of(self, worker: str) -> list[str]:
        return [f"{m}--{worker}" if self.private else m for m in self.sc.models]

    def start(self) -> None:
        env: dict[str, str] = {}
        if any(c is None for c in self.sc.models.values()):
            env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # two MiniLM workers share two cores
        for w, slow in zip(self.names, self.sc.slowdowns, strict=True):
            argv = [sys.executable, "-m", "lorafleet.sidecar", "--fleet", str(self.fleet_file),
                    "--nats-url", self.nats_url, "--worker-id", w, "--log-level", "WARNING"]
            for b in self.bases_of(w):
                argv += ["--base", b]
            self.procs[w] = spawn(argv, self.work / f"{self.sc.name}-{self.policy}-{w}.log",
                                  {**env, SLOWDOWN_ENV: str(slow)})

    def stop(self) -> None:
        # All at once, briefly: the queue is already settled, a graceful drain has nothing left to do.
        stop_all(list(self.procs.values()), timeout=5.0)
        self.procs.clear()

    def check_alive(self) -> None:
        for w, p in self.procs.items():
            if p.poll() is not None:
                log = self.work / f"{self.sc.name}-{self.policy}-{w}.log"
                tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
                raise RuntimeError(f"worker {w} exited with code {p.returncode}:\n{tail}")


# -- the driver (plays the gateway) and the push router ------------------------------------------

class Driver:
    def __init__(self, nc: Any, queue: QueueConfig, replicas: int = 1) -> None:
        self.nc, self.js, self.queue, self.replicas = nc, nc.jetstream(), queue, replicas
        self.futures: dict[str, asyncio.Future[Result]] = {}
        self.heartbeats: dict[str, float] = {}

    async def start(self) -> None:
        from lorafleet.nats.queue import ensure_streams

        await ensure_streams(self.js, self.queue, replicas=self.replicas)
        await self.nc.subscribe(INBOX + ".>", cb=self._on_result)
        await heartbeats.subscribe(self.nc, self._on_heartbeat)

    async def _on_result(self, msg: Any) -> None:
        if msg.reply:  # the worker acks a task only after this receipt, as the gateway gives it
            await self.nc.publish(msg.reply, b"")
        try:
            r = Result.from_wire(msg.data)
        except Exception:
            return
        fut = self.futures.pop(r.task_id, None)
        if fut is not None and not fut.done():
            fut.set_result(r)

    def _on_heartbeat(self, hb: Heartbeat) -> None:
        self.heartbeats[hb.worker] = time.monotonic()

    async def wait_workers(self, workers: Workers, timeout: float) -> None:
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            workers.check_alive()
            if all(self.heartbeats.get(w, 0) > t0 for w in workers.names):
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"workers {workers.names} did not all report within {timeout:.0f}s")

    async def settle(self, timeout: float = 20.0) -> int:
        """Until no task is queued or held; purge what is left after `timeout`. Returns tasks purged."""
        deadline = time.monotonic() + timeout
        left = 0
        while time.monotonic() < deadline:
            infos = await self.js.consumers_info(self.queue.stream)
            left = sum((i.num_pending or 0) + (i.num_ack_pending or 0) for i in infos)
            if left == 0:
                return 0
            await asyncio.sleep(0.1)
        await self.js.purge_stream(self.queue.stream)
        await asyncio.sleep(1.0)
        return left


class Router:
    """Where each task goes: the shared subject (pull) or one worker's private queue (P2C push)."""

    def __init__(self, policy: str, workers: Workers, js: Any, seed: int, algorithm: str = "p2c") -> None:
        self.policy, self.workers, self.js, self.algorithm = policy, workers, js, algorithm
        self.names = workers.names
        self.outstanding = dict.fromkeys(self.names, 0)  # exact: sent and not yet answered
        self.snapshot = dict.fromkeys(self.names, 0)  # polled every POLL_S (push-stale)
        self.rng = random.Random(seed)
        self.polls = 0
        self.poll_lag_ms: list[float] = []
        self._poller: asyncio.Task[None] | None = None

    def choose(self) -> str:
        view = self.snapshot if self.policy == "push-stale" else self.outstanding
        if self.algorithm == "lor":  # least outstanding over all workers, random among ties
            low = min(view.values())
            return self.rng.choice([w for w in self.names if view[w] == low])
        a, b = self.rng.sample(self.names, 2) if len(self.names) > 1 else (self.names[0], self.names[0])
        if view[a] == view[b]:
            return a  # a and b are already a random pair
        return a if view[a] < view[b] else b

    async def start(self) -> None:
        if self.policy == "push-stale":
            self._poller = asyncio.create_task(self._poll_loop())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)

    async def _poll_once(self) -> None:
        t0 = time.perf_counter()
        names = [(w, consumer_name(b)) for w in self.names for b in self.workers.bases_of(w)]
        infos = await asyncio.gather(*(self.js.consumer_info(self.workers.stream, c) for _, c in names),
                                     return_exceptions=True)
        load = dict.fromkeys(self.names, 0)
        for (w, _), info in zip(names, infos, strict=True):
            if not isinstance(info, BaseException):
                load[w] += (info.num_pending or 0) + (info.num_ack_pending or 0)
        self.snapshot = load
        self.polls += 1
        self.poll_lag_ms.append((time.perf_counter() - t0) * 1000.0)

    async def _poll_loop(self) -> None:
        next_t = time.perf_counter()
        while True:
            # A failed poll keeps the old (staler) view, as a real router would.
            with contextlib.suppress(Exception):
                await self._poll_once()
            next_t += POLL_S
            await asyncio.sleep(max(next_t - time.perf_counter(), 0.0))


async def run_point(driver: Driver, router: Router, sc: Scenario, rate: float, duration_s: float, seed: int,
                    texts: list[str], tag: str) -> LoadResult:
    schedule = (burst_schedule if sc.bursts else poisson_schedule)(rate, duration_s, seed)
    rng = random.Random(seed + 1)
    models, weights = list(sc.mix), list(sc.mix.values())
    trace = [rng.choices(models, weights)[0] for _ in schedule]
    js = driver.js
    loop = asyncio.get_running_loop()
    deadline_s = 30.0

    async def call(i: int) -> bool:
        model = trace[i]
        worker = None
        if router.policy == "pull":
            base = model
        else:
            worker = router.choose()
            base = f"{model}--{worker}"
            router.outstanding[worker] += 1
        tid = f"{tag}-{i}"
        fut: asyncio.Future[Result] = loop.create_future()
        driver.futures[tid] = fut
        now = time.time()
        text = texts[i % len(texts)] if sc.models[model] is None else "x"
        task = Task(id=tid, request_id=tid, index=0, model=model, base=base, text=text, tokens=32 if text != "x" else 4,
                    deadline=now + deadline_s, reply=f"{INBOX}.{tid}", enqueued=now)
        try:
            await js.publish(work_subject(base), task.to_wire(), headers={HDR_MSG_ID: tid}, timeout=5.0)
            result = await asyncio.wait_for(fut, deadline_s)
            return result.ok
        finally:
            driver.futures.pop(tid, None)
            if worker is not None:
                router.outstanding[worker] -= 1

    return await open_loop_calls(call, schedule, level=rate, duration_s=duration_s, drain_s=deadline_s)


def point_summary(r: LoadResult, slo_ms: float) -> dict[str, Any]:
    s = r.summary()
    p99 = r.percentile(99)
    s["meets_slo"] = bool(r.ok and r.errors == 0 and p99 is not None and p99 <= slo_ms)
    return s


async def run_policy(driver: Driver, router: Router, sc: Scenario, rates: list[float], overload: float,
                     duration_s: float, seed: int, texts: list[str]) -> dict[str, Any]:
    await router.start()
    points: list[dict[str, Any]] = []
    slo_rate: float | None = None
    try:
        for k, rate in enumerate([*rates, overload]):
            is_overload = k == len(rates)
            if not is_overload and points and not points[-1]["meets_slo"]:
                continue  # past the SLO: only the saturation point is left
            # The saturation point runs three times as long: its throughput is the headline, not its p99.
            n_tries = 1 if is_overload else 1 + SLO_RETRIES
            tries: list[dict[str, Any]] = []
            for _ in range(n_tries):
                r = await run_point(driver, router, sc, rate, duration_s * (3 if is_overload else 1), seed + k,
                                    texts, f"{sc.name}-{router.policy}-{k}-{int(time.time() * 1000) % 10**8}")
                tries.append(point_summary(r, sc.slo_ms))
                if tries[-1]["meets_slo"] or is_overload:
                    break
                await driver.settle()
            # A rate over the SLO is run again on the same trace: one hiccup of a shared machine (a p99 is
            # the slowest 1 % of a few thousand tasks) should not end a policy's ladder. Same rule for every policy.
            s = min(tries, key=lambda t: (not t["meets_slo"], t["p99_ms"] if t["p99_ms"] is not None else 1e18))
            if len(tries) > 1:
                s["tries_p99_ms"] = [t["p99_ms"] for t in tries]
            s["overload"] = is_overload
            purged = await driver.settle()
            if purged:
                s["purged_after"] = purged
            points.append(s)
            if not is_overload and s["meets_slo"] and (slo_rate is None or slo_rate < rate) and \
                    all(p["meets_slo"] for p in points):
                slo_rate = rate
            again = f"  (tries: p99 {', '.join(fmt(v) for v in s['tries_p99_ms'])})" if "tries_p99_ms" in s else ""
            say(f"    {router.policy:<10} {rate:7.1f}/s{' (overload)' if is_overload else '':<11} → "
                f"{s['throughput_rps']:7.1f}/s  p50 {fmt(s['p50_ms'])}  p99 {fmt(s['p99_ms'])} ms  "
                f"errors {s['errors']}  {'ok' if s['meets_slo'] else 'over SLO'}  gen CPU {s['gen_cpu_pct']:.0f}%"
                f"{again}")
    finally:
        await router.stop()
    out: dict[str, Any] = {"max_rate_within_slo": slo_rate,
                           "saturation_rps": round(max(p["throughput_rps"] for p in points), 2), "points": points}
    if router.policy == "push-stale" and router.poll_lag_ms:
        out["polls"] = router.polls
        out["poll_round_trip_ms_p50"] = round(sorted(router.poll_lag_ms)[len(router.poll_lag_ms) // 2], 2)
    return out


async def run_scenario(sc: Scenario, nats_url: str, work: Path, profile: ServingProfile, queue: QueueConfig,
                       duration_s: float, seed: int, texts: list[str], quick: bool,
                       algorithm: str = "p2c") -> dict[str, Any]:
    cap = sc.nominal_capacity(profile.max_batch_items)
    fractions = [0.5, 1.0] if quick else sc.fractions
    rates = [round(f * cap, 1) for f in fractions]
    overload = round(sc.overload * cap, 1)
    say(f"  {sc.name}: {sc.description}; nominal capacity {cap:.0f}/s; SLO p99 ≤ {sc.slo_ms:g} ms")
    nc = await nats.connect(nats_url, max_reconnect_attempts=3, **options_from_env())  # admin, if auth is on
    driver = Driver(nc, queue)
    await driver.start()
    policies: dict[str, Any] = {}
    try:
        for group in (("pull",), ("push-stale", "push-fresh")):
            workers = Workers(sc, group[0], nats_url, work, profile, queue)
            workers.start()
            try:
                await driver.wait_workers(workers, timeout=180)
                for policy in group:
                    router = Router(policy, workers, driver.js, seed, algorithm)
                    policies[policy] = await run_policy(driver, router, sc, rates, overload, duration_s, seed, texts)
                    workers.check_alive()
            finally:
                workers.stop()
                await driver.settle(timeout=2.0)
    finally:
        await nc.drain()
    return {"description": sc.description, "models": {m: (list(c) if c else "real all-MiniLM-L6-v2")
                                                      for m, c in sc.models.items()},
            "mix": sc.mix, "worker_slowdowns": sc.slowdowns, "max_batch_ms": profile.max_batch_ms,
            "arrivals": "bursts" if sc.bursts else "poisson",
            "slo_p99_ms": sc.slo_ms, "nominal_capacity_rps": round(cap, 1), "offered_rates": rates,
            "overload_rate": overload, "heterogeneous": sc.heterogeneous, "policies": policies,
            "ratios": ratios(policies)}


async def run_pull(sc: Scenario, nats_url: str, work: Path, profile: ServingProfile, queue: QueueConfig,
                   replicas: int, rates: list[float], overload: float, duration_s: float, seed: int,
                   texts: list[str]) -> dict[str, Any]:
    """The pull policy alone on the server(s) at `nats_url` (one URL or a cluster's, comma-separated)."""
    nc = await nats.connect(server_urls(nats_url), max_reconnect_attempts=3, **options_from_env())
    driver = Driver(nc, queue, replicas)
    try:
        await driver.start()
        workers = Workers(sc, "pull", nats_url, work, profile, queue)
        workers.start()
        try:
            await driver.wait_workers(workers, timeout=180)
            return await run_policy(driver, Router("pull", workers, driver.js, seed), sc, rates, overload,
                                    duration_s, seed, texts)
        finally:
            workers.stop()
            await driver.settle(timeout=2.0)
    finally:
        await nc.drain()


def run_replication(sc: Scenario, work: Path, profile: ServingProfile, duration_s: float, seed: int,
                    quick: bool) -> dict[str, Any]:
    """Pull on one nats-server (R1) and on a 3-node cluster (R3), file streams, the same trace and workers."""
    cap = sc.nominal_capacity(profile.max_batch_items)
    rates = [round(f * cap, 1) for f in ([0.5, 1.0] if quick else sc.fractions)]
    overload = round(sc.overload * cap, 1)
    queue = QueueConfig(storage="file")
    say(f"  {REPLICATED}: {sc.description}; pull on 1 node (R1) vs 3 nodes (R3), file streams; "
        f"SLO p99 ≤ {sc.slo_ms:g} ms")
    policies: dict[str, Any] = {}
    for replicas in (1, 3):
        name = f"pull-r{replicas}"
        server: NatsServer | NatsCluster = NatsServer(work / "nats-r1") if replicas == 1 else \
            NatsCluster(work / "nats-r3", 3)
        server.start()
        try:
            run = dataclasses.replace(sc, name=f"{REPLICATED}-r{replicas}")
            policies[name] = asyncio.run(run_pull(run, server.url, work, profile, queue, replicas, rates, overload,
                                                  duration_s, seed, ["x"]))
        finally:
            server.stop()
    r1, r3 = policies["pull-r1"], policies["pull-r3"]
    ratio = {"max_rate_within_slo": _ratio(r3["max_rate_within_slo"], r1["max_rate_within_slo"]),
             "saturation": _ratio(r3["saturation_rps"], r1["saturation_rps"])}
    p99 = {f"{p1['level']}": [p1["p99_ms"], p3["p99_ms"]]
           for p1, p3 in zip(r1["points"], r3["points"], strict=False) if p1["level"] == p3["level"]}
    return {"description": f"pull on {sc.description}: one nats-server (R1) vs a 3-node cluster (R3), file streams",
            "slo_p99_ms": sc.slo_ms, "nominal_capacity_rps": round(cap, 1), "offered_rates": rates,
            "overload_rate": overload, "queue_storage": "file", "policies": policies,
            "p99_ms_r1_r3_by_rate": p99, "ratios": {"r3/r1": ratio}}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None:
        return None
    if not b:
        return float("inf") if a else None
    return round(a / b, 3)


def ratios(policies: dict[str, Any]) -> dict[str, Any]:
    pull = policies["pull"]
    out = {}
    for other in ("push-stale", "push-fresh"):
        o = policies.get(other)
        if o:
            out[f"pull/{other}"] = {
                "max_rate_within_slo": _ratio(pull["max_rate_within_slo"], o["max_rate_within_slo"]),
                "saturation": _ratio(pull["saturation_rps"], o["saturation_rps"]),
            }
    return out


VERDICT = {True: "MET", False: "MISSED", None: "not measured (no such scenario in this run)"}
TIE_TOLERANCE = 0.02  # "never below" allows this much: one policy's saturation varied 2.3 % over six runs


def targets(results: dict[str, Any]) -> dict[str, Any]:
    het = {n: r["ratios"]["pull/push-stale"]["max_rate_within_slo"]
           for n, r in results.items() if r.get("heterogeneous")}
    never_below = {n: r["ratios"]["pull/push-stale"] for n, r in results.items()}

    def ge(v: float | None, x: float) -> bool:
        return v is not None and v >= x

    return {
        "pull_ge_1.5x_stale_push_in_heterogeneous": {
            "ratios": het, "met": all(ge(v, 1.5) for v in het.values()) if het else None},  # None: not run
        "pull_never_below_stale_push": {
            "ratios": never_below, "tolerance": TIE_TOLERANCE,
            "met": all(ge(v["max_rate_within_slo"], 1.0 - TIE_TOLERANCE) and ge(v["saturation"], 1.0 - TIE_TOLERANCE)
                       for v in never_below.values()),
        },
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'scenario':<8} {'policy':<11} {'max rate ≤ SLO':>15} {'saturation':>11} {'p99 @ max':>10}")
    for name, r in result["scenarios"].items():
        if "error" in r:
            print(f"{name:<8} failed: {r['error']}")
            continue
        for pol, pr in r["policies"].items():
            at = next((p for p in pr["points"] if p["level"] == pr["max_rate_within_slo"] and not p["overload"]), None)
            print(f"{name:<8} {pol:<11} {fmt(pr['max_rate_within_slo']):>13}/s {pr['saturation_rps']:>9.1f}/s "
                  f"{fmt(at['p99_ms'] if at else None):>8}ms")
        for k, v in r["ratios"].items():
            print(f"{'':<8} {k}: rate within SLO ×{fmt(v['max_rate_within_slo'], 2)}, "
                  f"saturation ×{fmt(v['saturation'], 2)}")
    for k, t in result["targets"].items():
        print(f"target {k}: {VERDICT[t['met']]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("routing", __doc__)
    p.add_argument("--quick", action="store_true", help="equal and slow scenarios, two rates + overload, 1 s points.")
    p.add_argument("--scenarios", default=None, help="Comma-separated: equal,slow,models,bursts,minilm,replicated "
                   "(default all; --quick: equal,slow).")
    p.add_argument("--point-s", type=float, default=None, help="Seconds of arrivals per rate (default 3; quick 1).")
    p.add_argument("--slo-ms", type=float, default=500.0, help="p99 objective of the synthetic scenarios "
                   "(the MiniLM scenario uses twice this).")
    p.add_argument("--batches-in-flight", type=int, default=None,
                   help="Worker profile for every policy (default: lorafleet's default, 0: a worker pulls only "
                        "when idle; 1 pulls one batch ahead while one computes).")
    p.add_argument("--max-batch-items", type=int, default=None, help="Worker profile for every policy.")
    p.add_argument("--max-batch-ms", type=float, default=None,
                   help="Workers' batch time budget, the same for every policy (default: 0.4 × the scenario's SLO, "
                        "as a latency-bound deployment sets it; 0: no budget, batches cut by item count only).")
    p.add_argument("--push-algorithm", choices=list(ALGORITHMS), default="p2c",
                   help="How the push router picks a worker (default p2c: the stronger choice on stale load).")
    p.add_argument("--minilm-capacity", type=float, default=None,
                   help="Nominal capacity (req/s) of the minilm scenario's ladder (default: measured here, 2 workers × "
                        "raw one-thread batch-32 encode).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "routing.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    all_sc = scenarios(args.slo_ms)
    known = [*all_sc, REPLICATED]
    names = args.scenarios.split(",") if args.scenarios else (["equal", "slow"] if args.quick else known)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"error: unknown scenario(s) {unknown}; choose from {known}", file=sys.stderr)
        return 2
    duration = args.point_s or (1.0 if args.quick else 3.0)
    overrides = {k: v for k, v in {"batches_in_flight": args.batches_in_flight,
                                   "max_batch_items": args.max_batch_items}.items() if v is not None}
    profile = ServingProfile(**overrides)  # the same for every policy
    budget = "0.4 × SLO" if args.max_batch_ms is None else (args.max_batch_ms or None)
    queue = QueueConfig(storage="memory")
    info = machine_info()
    t0 = time.monotonic()
    say(f"bench/routing: scenarios {names}; {duration:g}s of arrivals per rate; load average {info['loadavg_start']}")
    texts = german_sentences(200, seed=args.seed) if MINILM in names else ["x"]
    if MINILM in names:
        all_sc[MINILM].capacity_hint = args.minilm_capacity or measure_minilm_capacity(texts)
        say(f"  {MINILM}: nominal capacity {all_sc[MINILM].capacity_hint:.0f} req/s")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-routing-") as tmp:
        work = Path(tmp)
        server = NatsServer(work / "nats").start()
        try:
            for n in names:
                try:
                    if n == REPLICATED:
                        equal = all_sc["equal"]
                        sc_profile = profile.model_copy(update={"max_batch_ms": scenario_budget_ms(equal, budget)})
                        results[n] = run_replication(equal, work, sc_profile, duration, args.seed, args.quick)
                        continue
                    sc_profile = profile.model_copy(update={"max_batch_ms": scenario_budget_ms(all_sc[n], budget)})
                    results[n] = asyncio.run(run_scenario(all_sc[n], server.url, work, sc_profile, queue, duration,
                                                          args.seed, texts, args.quick, args.push_algorithm))
                except Exception as exc:
                    say(f"  {n}: failed: {exc}")
                    results[n] = {"error": str(exc)}
        finally:
            server.stop()
    ok = {n: r for n, r in results.items() if "error" not in r and n != REPLICATED}  # pull vs push only
    result = {
        **run_head("routing", args.quick, info),
        "setup": {"profile": profile.model_dump(), "max_batch_ms": budget, "queue_storage": queue.storage,
                  "point_s": duration,
                  "push_algorithm": ALGORITHMS[args.push_algorithm],
                  "push_stale_poll_ms": POLL_S * 1000, "arrival_seed": args.seed,
                  "load_generator": "lorafleet.tune.loadgen.open_loop_calls (latency from intended send time)"},
        "scenarios": results,
        "targets": targets(ok) if ok else {},
        "wall_s": round(time.monotonic() - t0, 1),
    }
    return finish(args.out, result, print_table)


if __name__ == "__main__":
    sys.exit(main())
