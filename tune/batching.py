"""What the batching kinds share (retrieval, rerank): a worker's ServingProfile swept under HTTP load.

The probe (`Sweeper`) serves the adapter on a private cluster (nats-server, gateway, one worker) and measures a
profile under closed and open loop load; `BatchingSweep` is the kind half they share: candidates are
ServingProfiles, the recommendation is the highest throughput within the p99 objective (and memory limit) among
the qualifying precisions, and the files are report.py's. A kind adds its load, its guard and its grid.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgpack

from lorafleet.core.config import BaseModelSpec, FleetConfig, GatewayConfig, ServedModel, ServingProfile, WorkerConfig
from lorafleet.ops.cluster import LocalCluster
from lorafleet.tune.analysis import ProfileResult, Recommendation, pareto_front, recommend, score
from lorafleet.tune.config import TuneConfig, TuneError
from lorafleet.tune.kind import KindSweep, Say
from lorafleet.tune.loadgen import LoadResult, Target, closed_loop, open_loop
from lorafleet.tune.precision import PrecisionQuality
from lorafleet.tune.probe import SERVED_NAME, PeakMemory, load_texts, make_target, run_async, start_cluster
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


class Sweeper:
    """Runs the private cluster and measures profiles one after another (the embedding load: /v1/encode)."""

    def __init__(self, source: TuneSource, cfg: TuneConfig, work_dir: Path, say: Say) -> None:
        self.source, self.cfg, self.work_dir, self.say = source, cfg, work_dir, say
        self.cluster: LocalCluster | None = None
        self.texts = load_texts(seed=cfg.seed)
        self.open_rates: list[float] = []
        self.baseline_rps = 0.0

    def base(self, profile: ServingProfile) -> BaseModelSpec:
        return BaseModelSpec(name=self.source.base_name, source=self.source.base_source,
                             revision=self.source.base_revision, precision=profile.precision or "fp32")

    def gateway(self) -> GatewayConfig:
        return GatewayConfig(port=0, default_deadline_s=60.0)

    def fleet(self, profile: ServingProfile) -> FleetConfig:
        return FleetConfig(
            bases=[self.base(profile)],
            models=[ServedModel(name=SERVED_NAME, base=self.source.base_name, adapter=str(self.source.adapter_dir),
                                adapter_id=f"{SERVED_NAME}-adapter", profile=profile)],
            gateway=self.gateway(), worker=WorkerConfig(profile=profile, device=self.cfg.device),
        )

    def start(self, profile: ServingProfile) -> None:
        self.cluster = start_cluster(self.fleet(profile), self.work_dir / "cluster", timeout=240)
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

    def ready_request(self) -> tuple[str, bytes, str]:
        """Path, body and content type of the request that proves the worker serves the adapter."""
        return (f"/v1/encode/{SERVED_NAME}", msgpack.packb({"inputs": [self.texts[0]], "deadline_ms": 20_000}),
                "application/msgpack")

    def _wait_serving(self, timeout: float) -> None:
        """Until a request to the adapter succeeds: proves the (new) worker loaded base and adapter."""
        assert self.cluster is not None
        path, body, content_type = self.ready_request()
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, code in self.cluster.exited():
                raise TuneError(f"the {name} exited with code {code}; see {self.cluster.log_path(name)}")
            try:
                r = httpx.post(f"{self.cluster.gateway_url}{path}", content=body,
                               headers={"Content-Type": content_type}, timeout=60)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise TuneError(f"the tuning worker did not serve the adapter within {timeout:.0f}s ({last})")

    def target(self) -> Target:
        """The load every profile is measured under."""
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
            restart_s=restart_s, points=[p.summary() for p in points],
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


class BatchingSweep(KindSweep):
    """The half of a batching kind's sweep that retrieval and rerank share: ServingProfile candidates, the
    recommendation within `slo` (ms, request p99) and the memory limit, report.py's files."""

    cfg: TuneConfig
    probe: Sweeper

    @property
    def slo(self) -> float:
        return self.cfg.slo_p99_ms

    @property
    def memory_mb(self) -> float | None:
        return self.cfg.memory_gb * 1024 if self.cfg.memory_gb else None

    def default(self) -> ServingProfile:
        return ServingProfile(precision="fp32")  # fp32 is the reference every other precision is judged against

    def key(self, candidate: Any) -> tuple[Any, ...]:
        p = candidate
        return (p.max_batch_items, p.max_batch_tokens, p.max_wait_ms, p.batches_in_flight, p.precision or "fp32")

    def describe(self, candidate: Any) -> str:
        p = candidate
        return (f"{p.precision} items {p.max_batch_items} tokens {p.max_batch_tokens} wait {p.max_wait_ms:g} ms "
                f"in-flight {p.batches_in_flight}")

    def latency(self, r: ProfileResult) -> str:
        """The end of a measured profile's progress line: its p99 at the top offered rate, memory and errors."""
        p99 = f"{r.p99_ms:.0f}" if r.p99_ms is not None else "-"
        return (f"p99 {p99} ms @ {self.probe.open_rates[-1]:g} req/s, RSS {r.peak_rss_mb:.0f} MB"
                + (f", {r.errors} errors" if r.errors else "") + (f", {r.unsent} not sustained" if r.unsent else ""))

    def centre(self, results: list[ProfileResult]) -> ServingProfile:
        """The best profile so far: the centre of the next stage."""
        return max(results, key=lambda r: score(r, self.slo, self.memory_mb)).profile

    def finish(self, results: list[ProfileResult], quality: list[PrecisionQuality], out_dir: Path,
               wall_s: float) -> TuneResult:
        front = pareto_front(results)
        for r in front:
            r.on_front = True
        qualified = {q.precision for q in quality if q.qualified}
        rec = recommend([r for r in results if (r.profile.precision or "fp32") in qualified], self.slo,
                        self.memory_mb)
        if rec is None:
            raise TuneError("no profile could be measured without errors; see the worker log under "
                            f"{self.work_dir / 'cluster' / 'logs'}")
        rec.result.recommended = True
        result = TuneResult(out_dir, rec.result.profile, rec, results, front, self.probe.baseline_rps, wall_s,
                            quality=quality)
        result.files = write_outputs(result, self.cfg.model_copy(update={"slo_p99_ms": self.slo}), self.source)
        return result
