"""`lorafleet tune`: sweep the serving profile of one adapter on this machine and recommend one.

Why a staged grid and not Optuna: the space is four small, discrete, well-understood knobs; one
measured profile costs ~15 s here (worker restart + load points), so a budget of a few minutes
buys about ten profiles, too few for a sampler's model to beat a structured sweep; run-to-run noise
of 10–20 % (MEASURED.md) misleads a sampler more than a grid; and the grid stops early along
`max_batch_items` where throughput plateaus. The sweep is coordinate-wise: batch items first (the
knob that matters most), then wait window, batches in flight and token budget around the best so far.

Each profile runs on a fresh worker process (only the worker restarts; NATS and the gateway stay
up), because the pull loop reads `batches_in_flight` and `max_wait_ms` once at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgpack
import yaml
from pydantic import Field

from lorafleet import settings
from lorafleet.config import (
    BaseModelSpec,
    FleetConfig,
    GatewayConfig,
    ServedModel,
    ServingProfile,
    StrictModel,
    WorkerConfig,
)
from lorafleet.tune.analysis import ProfileResult, Recommendation, pareto_front, plateaued, recommend, score
from lorafleet.tune.loadgen import LoadResult, Target, closed_loop, open_loop

SERVED_NAME = "tuned"
_FALLBACK_TEXTS = [
    "Der Verkäufer einer Sache ist verpflichtet, dem Käufer die Sache zu übergeben.",
    "Die Kündigung des Arbeitsverhältnisses bedarf zu ihrer Wirksamkeit der Schriftform.",
    "Wer vorsätzlich oder fahrlässig das Eigentum eines anderen verletzt, ist zum Ersatz verpflichtet.",
    "Arbeitnehmer haben in jedem Kalenderjahr Anspruch auf bezahlten Erholungsurlaub.",
    "Der Mieter ist verpflichtet, dem Vermieter die vereinbarte Miete zu entrichten.",
]


class TuneError(RuntimeError):
    """The sweep cannot run (bad input, the cluster did not start); the message says what to fix."""


class TuneConfig(StrictModel):
    slo_p99_ms: float = Field(250.0, gt=0, description="Latency objective: p99 at the offered load.")
    memory_gb: float | None = Field(None, gt=0, description="Peak worker memory limit (RSS, GiB).")
    quick: bool = Field(False, description="Three profiles, short load points: well under a minute.")
    concurrencies: list[int] = Field(default_factory=lambda: [1, 8, 32], min_length=1)
    open_fractions: list[float] = Field(default_factory=lambda: [0.5, 0.8], min_length=1,
                                        description="Open-loop rates as fractions of the baseline's capacity.")
    point_s: float = Field(2.5, gt=0, description="Seconds per load point.")
    warmup_s: float = Field(1.0, ge=0)
    min_open_requests: int = Field(30, ge=1, description="An open-loop point lasts long enough for this many "
                                   "arrivals (at most 3 × point_s), so its p99 rests on more than a handful.")
    items_grid: list[int] = Field(default_factory=lambda: [1, 4, 8, 16, 32, 64], min_length=1)
    wait_grid: list[float] = Field(default_factory=lambda: [0.0, 8.0])
    inflight_grid: list[int] = Field(default_factory=lambda: [0, 1, 2])
    tokens_per_item_grid: list[int] = Field(default_factory=lambda: [24, 96],
                                            description="max_batch_tokens = items × this.")
    plateau_gain: float = Field(0.03, ge=0, description="A larger batch must add this much throughput.")
    plateau_patience: int = Field(1, ge=1)
    max_profiles: int = Field(12, ge=1)
    budget_s: float = Field(300.0, gt=0, description="Stop starting new profiles after this long.")
    seed: int = 0
    device: str = "auto"

    @classmethod
    def quick_preset(cls, **overrides: object) -> TuneConfig:
        base: dict[str, object] = dict(quick=True, concurrencies=[8], open_fractions=[0.6], point_s=1.2,
                                       warmup_s=0.3, items_grid=[1, 8], wait_grid=[], inflight_grid=[],
                                       min_open_requests=15, tokens_per_item_grid=[], max_profiles=3, budget_s=45.0)
        base.update(overrides)
        return cls(**base)


@dataclass
class TuneSource:
    """What is tuned: an adapter folder on a base model."""

    adapter_dir: Path
    base_source: str
    base_name: str
    base_revision: str | None
    label: str
    profile: ServingProfile | None = None  # the bundle's current profile, if it came from one


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


# -- what to tune ------------------------------------------------------------------------------

_RUN_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_REGISTRY_RE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:@(?P<alias>[A-Za-z0-9_-]+)|/(?P<version>v?\d+))$")


def resolve_source(ref: str, base: str | None = None) -> TuneSource:
    """An adapter folder, a bundle folder, an MLflow run id, or NAME@alias / NAME/version in the registry."""
    from lorafleet.registry.bundle import BUNDLE_FILE, read_spec

    path = Path(ref).expanduser()
    if path.is_dir():
        if (path / BUNDLE_FILE).is_file():
            spec = read_spec(path)
            return TuneSource(path / "adapter", base or spec.base.source, spec.base.name, spec.base.revision,
                              spec.name, spec.profile)
        if (path / "adapter_config.json").is_file():
            return _from_adapter(path, base, path.name)
        raise TuneError(f"{path} is neither a peft adapter folder (adapter_config.json) nor a bundle (bundle.yaml)")
    if ref.startswith(("/", "./", "../", "~")):
        raise TuneError(f"adapter folder {path} does not exist")
    m = _REGISTRY_RE.match(ref)
    if m and not _RUN_ID_RE.match(ref):
        from lorafleet.registry.store import fetch_adapter

        adapter_dir, spec, info = fetch_adapter(m.group("name"), m.group("alias") or m.group("version"))
        return TuneSource(adapter_dir, base or spec.base.source, spec.base.name, spec.base.revision,
                          f"{info.name}-v{info.version}", spec.profile)
    if _RUN_ID_RE.match(ref):
        return _from_run(ref, base)
    raise TuneError(f"{ref!r} is not an adapter folder, a bundle folder, an MLflow run id (32 hex digits), "
                    "or a registered NAME@alias / NAME/version")


def _from_adapter(path: Path, base: str | None, label: str) -> TuneSource:
    from lorafleet.models import resolve_model_source
    from lorafleet.registry.bundle import adapter_base_source, base_name_for

    source = base or adapter_base_source(path)
    if not source:
        raise TuneError(f"{path}/adapter_config.json names no base model; pass --base")
    resolved = resolve_model_source(source)
    if source.startswith("/") and not Path(resolved).exists():
        raise TuneError(f"the adapter's base model {source} is not on this machine; pass --base")
    return TuneSource(path, source, base_name_for(source), None, label)


def _from_run(run_id: str, base: str | None) -> TuneSource:
    from mlflow.artifacts import download_artifacts

    from lorafleet.registry.store import client, tracking_uri

    c = client()
    try:
        c.get_run(run_id)
    except Exception as exc:
        raise TuneError(f"MLflow run {run_id} does not exist in {tracking_uri()}") from exc

    def find(path: str = "", depth: int = 0) -> str | None:
        for item in c.list_artifacts(run_id, path or None):
            if not item.is_dir and item.path.endswith("adapter_config.json"):
                return path
        if depth < 3:
            for item in c.list_artifacts(run_id, path or None):
                if item.is_dir and (found := find(item.path, depth + 1)) is not None:
                    return found
        return None

    found = find()
    if found is None:
        raise TuneError(f"MLflow run {run_id} has no logged adapter (no adapter_config.json among its artifacts)")
    dest = settings.home() / "tune" / "runs" / run_id
    if dest.exists():
        shutil.rmtree(dest)
    local = Path(download_artifacts(run_id=run_id, artifact_path=found, dst_path=str(dest),
                                    tracking_uri=tracking_uri()))
    return _from_adapter(local, base, f"run-{run_id[:8]}")


# -- load ---------------------------------------------------------------------------------------

def load_texts(n: int = 400, seed: int = 0) -> list[str]:
    """Single sentences of 5–25 words from the statutes (LORAFLEET_DATA_DIR), else a built-in handful."""
    try:
        files = sorted((settings.data_dir() / "gesetze").glob("*.md"))
    except Exception:
        files = []
    sentences: list[str] = []
    for f in files[:6]:
        text = " ".join(line.strip() for line in f.read_text(errors="replace").splitlines()
                        if line.strip() and not line.lstrip().startswith(("#", ":", "-", "|")))
        for s in re.split(r"(?<=[.;])\s+", text):
            words = s.split()
            if 5 <= len(words) <= 25:
                sentences.append(" ".join(words))
    if len(sentences) < 20:
        return list(_FALLBACK_TEXTS)
    rng = random.Random(seed)
    rng.shuffle(sentences)
    return sentences[:n]


def make_target(gateway_url: str, model: str, texts: list[str]) -> Target:
    m = re.match(r"^http://([^:/]+):(\d+)", gateway_url)
    if not m:
        raise TuneError(f"unsupported gateway URL {gateway_url}")
    bodies = [msgpack.packb({"inputs": [t]}) for t in texts]
    return Target(m.group(1), int(m.group(2)), f"/v1/encode/{model}", lambda i: bodies[i % len(bodies)])


# -- memory ------------------------------------------------------------------------------------

class PeakMemory:
    """Samples a process (and its children) every `interval_s` for peak RSS, and GPU memory when there is one."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak_rss = 0
        self.peak_gpu_mb: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)
        self._nvidia = shutil.which("nvidia-smi")

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        import psutil

        try:
            proc = psutil.Process(self.pid)
        except psutil.Error:
            return
        ticks = 0
        while not self._stop.is_set():
            try:
                rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
                self.peak_rss = max(self.peak_rss, rss)
            except psutil.Error:
                return
            if self._nvidia and ticks % 10 == 0:  # nvidia-smi is slow; once a second is enough
                gpu = _gpu_mb(self._nvidia, self.pid)
                if gpu is not None:
                    self.peak_gpu_mb = max(self.peak_gpu_mb or 0.0, gpu)
            ticks += 1
            self._stop.wait(self.interval_s)


def _gpu_mb(nvidia_smi: str, pid: int) -> float | None:
    try:
        out = subprocess.run([nvidia_smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    total = [float(used) for line in out.splitlines() if "," in line
             for p, used in [line.split(",", 1)] if p.strip() == str(pid)]
    return sum(total) if total else None


# -- the sweep ---------------------------------------------------------------------------------

Say = Callable[[str], None]


class Sweeper:
    """Runs the private cluster and measures profiles one after another."""

    def __init__(self, source: TuneSource, cfg: TuneConfig, work_dir: Path, say: Say) -> None:
        self.source, self.cfg, self.work_dir, self.say = source, cfg, work_dir, say
        self.cluster = None  # serve.cluster.LocalCluster
        self.texts = load_texts(seed=cfg.seed)
        self.open_rates: list[float] = []
        self.baseline_rps = 0.0

    def fleet(self, profile: ServingProfile) -> FleetConfig:
        return FleetConfig(
            bases=[BaseModelSpec(name=self.source.base_name, source=self.source.base_source,
                                 revision=self.source.base_revision)],
            models=[ServedModel(name=SERVED_NAME, base=self.source.base_name, adapter=str(self.source.adapter_dir),
                                adapter_id=f"{SERVED_NAME}-adapter", profile=profile)],
            gateway=GatewayConfig(port=0, default_deadline_s=60.0),
            worker=WorkerConfig(profile=profile, device=self.cfg.device),
        )

    def start(self, profile: ServingProfile) -> None:
        from lorafleet.nats_server import free_port
        from lorafleet.serve.cluster import ClusterError, LocalCluster

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
        from lorafleet.serve.cluster import stop_group

        c = self.cluster
        assert c is not None and c.state is not None
        t0 = time.monotonic()
        proc = c.procs.pop("worker-1", None)
        if proc is not None:
            stop_group(proc.pid, 30.0, "worker-1")
        Path(c.state.fleet_file).write_text(yaml.safe_dump(self.fleet(profile).model_copy(
            update={"nats_url": c.nats_url}).model_dump(mode="json"), sort_keys=False))
        c.start_worker("worker-1")
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
            proc = self.cluster.procs.get("worker-1")
            if proc is not None and proc.poll() is not None:
                log = self.cluster.home / "logs" / "worker-1.log"
                raise TuneError(f"the worker exited with code {proc.returncode}; see {log}")
            try:
                r = httpx.post(url, content=body, headers={"Content-Type": "application/msgpack"}, timeout=30)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise TuneError(f"the tuning worker did not serve the adapter within {timeout:.0f}s ({last})")

    def measure(self, profile: ServingProfile, phase: str, restart_s: float) -> ProfileResult:
        assert self.cluster is not None
        target = make_target(self.cluster.gateway_url, SERVED_NAME, self.texts)
        pid = self.cluster.procs["worker-1"].pid
        cfg = self.cfg
        points: list[LoadResult] = []
        with PeakMemory(pid) as mem:
            if cfg.warmup_s:
                _run_async(closed_loop(target, max(cfg.concurrencies), cfg.warmup_s))
            for c in cfg.concurrencies:
                points.append(_run_async(closed_loop(target, c, cfg.point_s)))
            throughput = max(p.throughput for p in points)
            if not self.open_rates:  # the first (baseline) profile fixes the offered rates for all
                self.calibrate(target, throughput)
            for i, rate in enumerate(self.open_rates):
                duration = min(max(cfg.point_s, cfg.min_open_requests / rate), 3 * cfg.point_s)
                points.append(_run_async(open_loop(target, rate, duration, seed=cfg.seed + i)))
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
        _run_async(closed_loop(target, top, 2 * cfg.warmup_s))
        runs = [measured] + [_run_async(closed_loop(target, top, cfg.point_s)).throughput for _ in range(2)]
        self.baseline_rps = sorted(runs)[1]  # the median of three
        self.open_rates = [round(max(f * self.baseline_rps, 1.0), 1) for f in cfg.open_fractions]
        self.say(f"  default profile's capacity {self.baseline_rps:.1f} req/s (runs: "
                 f"{', '.join(f'{r:.1f}' for r in runs)}); open-loop rates {self.open_rates} req/s")


def _run_async(coro: object) -> LoadResult:
    try:
        import uvloop

        return uvloop.run(coro)  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)  # type: ignore[arg-type]


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
                          batches_in_flight=inflight)


def run_tune(ref: str | TuneSource, cfg: TuneConfig | None = None, out_dir: Path | None = None,
             base: str | None = None, say: Say | None = None) -> TuneResult:
    """Sweep, write profile.yaml / results.csv / results.json / throughput_p99.png, return the result."""
    from lorafleet.tune.report import write_outputs

    cfg = cfg or TuneConfig()
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    source = ref if isinstance(ref, TuneSource) else resolve_source(ref, base)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(out_dir) if out_dir else settings.home() / "tune" / f"{source.label}-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / ".work"
    t0 = time.monotonic()
    default = ServingProfile()
    sweeper = Sweeper(source, cfg, work, say)
    results: list[ProfileResult] = []
    seen: set[tuple[int, int, float, int]] = set()
    say(f"tune: {source.label} on {source.base_name}; SLO p99 ≤ {cfg.slo_p99_ms:g} ms"
        + (f", memory ≤ {cfg.memory_gb:g} GiB" if cfg.memory_gb else "") + f"; budget {cfg.budget_s:.0f}s")
    memory_mb = cfg.memory_gb * 1024 if cfg.memory_gb else None

    def run_one(profile: ServingProfile, phase: str, first: bool = False) -> ProfileResult | None:
        key = (profile.max_batch_items, profile.max_batch_tokens, profile.max_wait_ms, profile.batches_in_flight)
        if key in seen:
            return next(r for r in results if r.key() == key)
        if not first and (len(results) >= cfg.max_profiles or (time.monotonic() - t0) > cfg.budget_s):
            return None
        seen.add(key)
        restart = 0.0 if first else sweeper.apply(profile)
        r = sweeper.measure(profile, phase, restart)
        results.append(r)
        p99 = f"{r.p99_ms:.0f}" if r.p99_ms is not None else "-"
        say(f"  [{len(results):>2}] items {profile.max_batch_items:>3} tokens {profile.max_batch_tokens:>5} "
            f"wait {profile.max_wait_ms:>4g} ms in-flight {profile.batches_in_flight}: {r.throughput_rps:6.1f} req/s, "
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
        ok = True
    finally:
        restore()
        sweeper.stop()
        if ok:  # keep the cluster logs when something failed
            shutil.rmtree(work, ignore_errors=True)
    front = pareto_front(results)
    for r in front:
        r.on_front = True
    rec = recommend(results, cfg.slo_p99_ms, memory_mb)
    if rec is None:
        raise TuneError("no profile could be measured without errors; see the worker log under "
                        f"{work / 'cluster' / 'logs'}")
    rec.result.recommended = True
    result = TuneResult(out_dir, rec.result.profile, rec, results, front, sweeper.baseline_rps,
                        time.monotonic() - t0)
    result.files = write_outputs(result, cfg, source)
    with contextlib.suppress(Exception):
        say(f"recommended: {rec.result.profile.model_dump()} — {rec.reason}: {rec.result.throughput_rps:.1f} req/s, "
            f"p99 {rec.result.p99_ms:.0f} ms; outputs in {out_dir} ({result.wall_s:.0f}s)")
    return result
