"""`lorafleet tune`: sweep the serving profile of one adapter on this machine and recommend one.

Why a staged grid and not Optuna: the space is four small, discrete, well-understood knobs; one
measured profile costs ~15 s here (worker restart + load points), so a budget of a few minutes
buys about ten profiles, too few for a sampler's model to beat a structured sweep; run-to-run noise
of 10–20 % on a shared machine misleads a sampler more than a grid; and the grid stops early along
`max_batch_items` where throughput plateaus. The sweep is coordinate-wise: batch items first (the
knob that matters most), then wait window, batches in flight and token budget around the best so far.

Each profile runs on a fresh worker process (only the worker restarts; NATS and the gateway stay
up), because the pull loop reads `batches_in_flight` and `max_wait_ms` once at start.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgpack

from lorafleet.core import settings
from lorafleet.core.config import BaseModelSpec, FleetConfig, GatewayConfig, ServedModel, ServingProfile, WorkerConfig
from lorafleet.nats.server import free_port
from lorafleet.ops.cluster import ClusterError, LocalCluster
from lorafleet.tune.analysis import ProfileResult, Recommendation, pareto_front, plateaued, recommend, score
from lorafleet.tune.config import GenerativeTuneConfig, TuneConfig, TuneError
from lorafleet.tune.generative import GenerativeTuneResult, is_generative, run_generative_tune
from lorafleet.tune.loadgen import LoadResult, Target, closed_loop, open_loop
from lorafleet.tune.precision import PrecisionQuality, run_guard
from lorafleet.tune.probe import SERVED_NAME, PeakMemory, load_texts, make_target, run_async
from lorafleet.tune.report import write_outputs
from lorafleet.tune.source import TuneSource


@dataclass
class TuneResult:
    out_dir: Path
    profile: ServingProfile
    recommendation: Recommendation
    results: list[ProfileResult]
    front: list[ProfileResult]
    baseline_rps: float
    wall_s: float
    files: dict[str, Path] = field(default_factory=dict)
    quality: list[PrecisionQuality] = field(default_factory=list)  # the guard's verdict per precision


Say = Callable[[str], None]


class Sweeper:
    """Runs the private cluster and measures profiles one after another."""

    def __init__(self, source: TuneSource, cfg: TuneConfig, work_dir: Path, say: Say) -> None:
        self.source, self.cfg, self.work_dir, self.say = source, cfg, work_dir, say
        self.cluster: LocalCluster | None = None
        self.texts = load_texts(seed=cfg.seed)
        self.open_rates: list[float] = []
        self.baseline_rps = 0.0

    def fleet(self, profile: ServingProfile) -> FleetConfig:
        return FleetConfig(
            bases=[BaseModelSpec(name=self.source.base_name, source=self.source.base_source,
                                 revision=self.source.base_revision, precision=profile.precision or "fp32")],
            models=[ServedModel(name=SERVED_NAME, base=self.source.base_name, adapter=str(self.source.adapter_dir),
                                adapter_id=f"{SERVED_NAME}-adapter", profile=profile)],
            gateway=GatewayConfig(port=0, default_deadline_s=60.0),
            worker=WorkerConfig(profile=profile, device=self.cfg.device),
        )

    def start(self, profile: ServingProfile) -> None:
        self.cluster = LocalCluster(self.fleet(profile), workers=1, port=0, home=self.work_dir / "cluster",
                                    nats_port=free_port())
        try:
            self.cluster.start(timeout=240)
        except ClusterError as exc:
            raise TuneError(f"the tuning cluster did not start: {exc}") from exc
        self._wait_serving(timeout=120)

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    def apply(self, profile: ServingProfile) -> float:
        """Restart only the worker with `profile`; seconds until it serves the adapter again."""
        assert self.cluster is not None
        t0 = time.monotonic()
        self.cluster.restart_worker("worker-1", self.fleet(profile))
        self._wait_serving(timeout=120)
        return time.monotonic() - t0

    def _wait_serving(self, timeout: float) -> None:
        """Until a request to the adapter succeeds: proves the (new) worker loaded base and adapter."""
        assert self.cluster is not None
        url = f"{self.cluster.gateway_url}/v1/encode/{SERVED_NAME}"
        body = msgpack.packb({"inputs": [self.texts[0]], "deadline_ms": 20_000})
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, code in self.cluster.exited():
                raise TuneError(f"the {name} exited with code {code}; see {self.cluster.log_path(name)}")
            try:
                r = httpx.post(url, content=body, headers={"Content-Type": "application/msgpack"}, timeout=30)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise TuneError(f"the tuning worker did not serve the adapter within {timeout:.0f}s ({last})")

    def target(self) -> Target:
        """The load every profile is measured under (score.py: rerank requests instead)."""
        assert self.cluster is not None
        return make_target(self.cluster.gateway_url, SERVED_NAME, self.texts)

    def measure(self, profile: ServingProfile, phase: str, restart_s: float) -> ProfileResult:
        assert self.cluster is not None
        target = self.target()
        pid = self.cluster.pid("worker-1")
        cfg = self.cfg
        points: list[LoadResult] = []
        with PeakMemory(pid) as mem:
            if cfg.warmup_s:
                run_async(closed_loop(target, max(cfg.concurrencies), cfg.warmup_s))
            for c in cfg.concurrencies:
                points.append(run_async(closed_loop(target, c, cfg.point_s)))
            throughput = max(p.throughput for p in points)
            if not self.open_rates:  # the first (baseline) profile fixes the offered rates for all
                self.calibrate(target, throughput)
            for i, rate in enumerate(self.open_rates):
                duration = min(max(cfg.point_s, cfg.min_open_requests / rate), 3 * cfg.point_s)
                points.append(run_async(open_loop(target, rate, duration, seed=cfg.seed + i)))
        headline = points[-1]
        gen_cpu = sum(p.gen_cpu_s for p in points) / max(sum(p.duration_s for p in points), 1e-9) * 100.0
        return ProfileResult(
            profile=profile, phase=phase, throughput_rps=throughput, p50_ms=headline.percentile(50),
            p99_ms=headline.percentile(99), peak_rss_mb=mem.peak_rss / 2**20, peak_gpu_mb=mem.peak_gpu_mb,
            errors=sum(p.errors for p in points), unsent=sum(p.unsent for p in points), gen_cpu_pct=gen_cpu,
            restart_s=restart_s,
            points=[p.summary() for p in points],
        )


    def calibrate(self, target: Target, measured: float) -> None:
        """Offered open-loop rates from the default profile's capacity, measured twice more after a longer
        warm-up: a cold worker or a passing burst of other load would otherwise set every rate too low."""
        cfg = self.cfg
        top = max(cfg.concurrencies)
        run_async(closed_loop(target, top, 2 * cfg.warmup_s))
        runs = [measured] + [run_async(closed_loop(target, top, cfg.point_s)).throughput for _ in range(2)]
        self.baseline_rps = sorted(runs)[1]  # the median of three
        self.open_rates = [round(max(f * self.baseline_rps, 1.0), 1) for f in cfg.open_fractions]
        self.say(f"  default profile's capacity {self.baseline_rps:.1f} req/s (runs: "
                 f"{', '.join(f'{r:.1f}' for r in runs)}); open-loop rates {self.open_rates} req/s")


def _terminate_as_interrupt() -> Callable[[], None]:
    """While the sweep runs, SIGTERM unwinds like Ctrl-C, so the private cluster is always stopped."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _profile(items: int, tokens: int, wait: float, inflight: int) -> ServingProfile:
    return ServingProfile(max_batch_items=items, max_batch_tokens=max(tokens, items), max_wait_ms=wait,
                          batches_in_flight=inflight, precision="fp32")


def run_tune(source: TuneSource, cfg: TuneConfig | None = None, out_dir: Path | None = None,
             say: Say | None = None, generative: GenerativeTuneConfig | None = None
             ) -> TuneResult | GenerativeTuneResult:
    """Sweep, write profile.yaml / results.csv / results.json / throughput_p99.png, return the result.

    A LoRA of a causal LM gets the generative sweep instead (generative.py: the engine options of its base),
    with `generative` or, from `cfg`, its quick preset and memory limit.
    """
    cfg = cfg or TuneConfig()
    from lorafleet.tune.score import is_score, run_score_tune

    if is_score(source):  # a cross-encoder's LoRA: rerank requests, pairs/s (score.py)
        return run_score_tune(source, cfg, out_dir, say)
    if is_generative(source):
        if generative is None:
            generative = GenerativeTuneConfig.quick_preset() if cfg.quick else GenerativeTuneConfig()
            generative = generative.model_copy(update={"memory_gb": cfg.memory_gb, "device": cfg.device,
                                                       "slo_ttft_p99_ms": cfg.slo_ttft_p99_ms,
                                                       "precision_max_loss": cfg.precision_max_loss})
        return run_generative_tune(source, generative, out_dir, say)
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(out_dir) if out_dir else settings.home() / "tune" / f"{source.label}-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / ".work"
    t0 = time.monotonic()
    default = ServingProfile(precision="fp32")  # fp32 is the reference every other precision is judged against
    sweeper = Sweeper(source, cfg, work, say)
    results: list[ProfileResult] = []
    seen: set[tuple[int, int, float, int, str]] = set()
    say(f"tune: {source.label} on {source.base_name}; SLO p99 ≤ {cfg.slo_p99_ms:g} ms"
        + (f", memory ≤ {cfg.memory_gb:g} GiB" if cfg.memory_gb else "") + f"; budget {cfg.budget_s:.0f}s")
    memory_mb = cfg.memory_gb * 1024 if cfg.memory_gb else None
    # Precision: judged once each before any load (the guard), then the qualifying ones re-measure the best fp32
    # profiles; those measurements are reserved out of max_profiles so the staged sweep leaves room for them.
    quality = run_guard(source, cfg, say)
    faster = [q.precision for q in quality if q.qualified and q.precision != "fp32"]
    reserved = min(len(faster) * cfg.precision_profiles, max(cfg.max_profiles - 2, 0))
    staged_cap = cfg.max_profiles - reserved
    # At most this many profiles (the grid, capped): a plateau, a repeat or the budget can end the sweep sooner.
    at_most = min(staged_cap, 1 + len(cfg.items_grid) + len(cfg.wait_grid) + len(cfg.inflight_grid)
                  + len(cfg.tokens_per_item_grid)) + reserved

    def run_one(profile: ServingProfile, phase: str, first: bool = False, cap: int = staged_cap
                ) -> ProfileResult | None:
        key = (profile.max_batch_items, profile.max_batch_tokens, profile.max_wait_ms, profile.batches_in_flight,
               profile.precision or "fp32")
        if key in seen:
            return next(r for r in results if r.key() == key)
        if not first and (len(results) >= cap or (time.monotonic() - t0) > cfg.budget_s):
            return None
        seen.add(key)
        # Each profile takes a worker restart and several load points (15 s or more): say which one runs.
        say(f"  profile {len(results) + 1}/≤{at_most} ({phase}): {profile.precision} items {profile.max_batch_items} "
            f"tokens {profile.max_batch_tokens} wait {profile.max_wait_ms:g} ms in-flight {profile.batches_in_flight} "
            f"measuring…  ({time.monotonic() - t0:.0f}s of {cfg.budget_s:.0f}s)")
        restart = 0.0 if first else sweeper.apply(profile)
        r = sweeper.measure(profile, phase, restart)
        results.append(r)
        p99 = f"{r.p99_ms:.0f}" if r.p99_ms is not None else "-"
        say(f"  [{len(results):>2}/{at_most}] items {profile.max_batch_items:>3} tokens {profile.max_batch_tokens:>5} "
            f"wait {profile.max_wait_ms:>4g} ms in-flight {profile.batches_in_flight} {profile.precision}: "
            f"{r.throughput_rps:6.1f} req/s, "
            f"p99 {p99} ms @ {sweeper.open_rates[-1]:g} req/s, RSS {r.peak_rss_mb:.0f} MB"
            + (f", {r.errors} errors" if r.errors else "")
            + (f", {r.unsent} not sustained" if r.unsent else "") + f"  ({time.monotonic() - t0:.0f}s)")
        return r

    ok = False
    restore = _terminate_as_interrupt()
    try:
        say("  starting a private cluster (nats-server, gateway, one worker)…")
        # The fleet's default profile goes first: its capacity fixes the open-loop rates for every profile,
        # so all p99 figures are taken at the same offered load.
        sweeper.start(default)
        run_one(default, "baseline", first=True)
        # Phase 1: batch items, ascending, until throughput plateaus.
        history: list[float] = []
        for items in cfg.items_grid:
            r = run_one(_profile(items, default.max_batch_tokens, default.max_wait_ms, default.batches_in_flight),
                        "items")
            if r is None:
                break
            history.append(r.throughput_rps)
            if plateaued(history, cfg.plateau_gain, cfg.plateau_patience):
                say(f"  throughput plateaued at {max(history):.1f} req/s; larger batches skipped")
                break

        def centre() -> ServingProfile:
            return max(results, key=lambda r: score(r, cfg.slo_p99_ms, memory_mb)).profile

        # Phases 2–4: wait window, batches in flight, token budget, each around the best so far.
        for wait in cfg.wait_grid:
            run_one(centre().model_copy(update={"max_wait_ms": wait}), "wait")
        for inflight in cfg.inflight_grid:
            run_one(centre().model_copy(update={"batches_in_flight": inflight}), "in_flight")
        for per_item in cfg.tokens_per_item_grid:
            c = centre()
            run_one(c.model_copy(update={"max_batch_tokens": c.max_batch_items * per_item}), "tokens")
        # Phase 5: each qualifying precision on the best fp32 profiles (batch knobs barely interact with it).
        best = sorted(results, key=lambda r: score(r, cfg.slo_p99_ms, memory_mb), reverse=True)
        for p in faster:
            for r in best[: cfg.precision_profiles]:
                run_one(r.profile.model_copy(update={"precision": p}), "precision", cap=cfg.max_profiles)
        ok = True
    finally:
        restore()
        sweeper.stop()
        if ok:  # keep the cluster logs when something failed
            shutil.rmtree(work, ignore_errors=True)
    front = pareto_front(results)
    for r in front:
        r.on_front = True
    qualified = {q.precision for q in quality if q.qualified}
    rec = recommend([r for r in results if (r.profile.precision or "fp32") in qualified], cfg.slo_p99_ms, memory_mb)
    if rec is None:
        raise TuneError("no profile could be measured without errors; see the worker log under "
                        f"{work / 'cluster' / 'logs'}")
    rec.result.recommended = True
    result = TuneResult(out_dir, rec.result.profile, rec, results, front, sweeper.baseline_rps,
                        time.monotonic() - t0, quality=quality)
    result.files = write_outputs(result, cfg, source)
    with contextlib.suppress(Exception):
        say(f"recommended: {rec.result.profile.model_dump()} — {rec.reason}: {rec.result.throughput_rps:.1f} req/s, "
            f"p99 {rec.result.p99_ms:.0f} ms; outputs in {out_dir} ({result.wall_s:.0f}s)")
    return result
