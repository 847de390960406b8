"""`lorafleet tune` for a generative specialist: sweep the engine options of its base on a private cluster.

An engine batches continuously, so the embedding sweep's knobs (batch items, wait window) do not
apply; what decides its throughput and latency are the engine's options, swept here in the same
staged, coordinate-wise way (see sweep.py for why a staged grid and not a sampler): `max_num_seqs`
ascending until output tokens/s plateau, then `max_num_batched_tokens`, the KV-cache space (CPU) or
GPU memory share (CUDA), and the worker's slot target (sequences it keeps in flight, as a share of
`max_num_seqs`) around the best so far. Right after `max_num_seqs` come the adapter caches: `max_loras`
(adapters in one engine step) and `max_cpu_loras` (adapters the engine keeps in host memory), measured
under a multi-adapter load: the specialist's adapter and `adapters - 1` copies of it under other ids,
requests spread round-robin over them, so the engine really juggles several LoRAs (copies cost the
engine what distinct adapters do: it cannot tell them apart). Every profile restarts only the worker
(a new engine: ~30 s on a CPU). Each is measured with streaming requests to the adapters (greedy,
`max_tokens` each), closed loop at each concurrency: output tokens/s (the best), time to first token
p50/p99 and inter-token latency at the highest concurrency, peak memory of the worker with its
engine. The recommendation is the highest throughput whose TTFT p99 meets the objective (and the
memory limit).

Before any of that, the precision (issue 39): the gate scored the specialist in fp32, and vLLM's own CPU default is
bf16. The worker is started at each precision the engine may serve, the specialist's dev prompts are answered
through the gateway, and a precision whose dev ROUGE-L falls more than `precision_max_loss` below fp32's is refused
(generation_guard.py); every profile is then measured at the fastest qualifying one, which the result's profile (so
the bundle) records and a base under `precision: auto` serves.

The engine's options belong to its base (one engine serves every adapter of a base), so the result
is a set of `bases[].options` for the fleet file (profile.yaml), not a bundle's batching profile; the
adapter-cache sizes among them too. The worker keeps as many adapters registered on the engine as the
engine caches in host memory (`VllmRuntime.adapter_capacity`, i.e. max_cpu_loras), so max_cpu_loras is
also the worker's adapter bound on that base.
"""

from __future__ import annotations

import asyncio
import csv
import json
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from lorafleet.core import plugins, settings
from lorafleet.core.config import BaseModelSpec, FleetConfig, GatewayConfig, ServedModel, ServingProfile, WorkerConfig
from lorafleet.models.precision import FP32
from lorafleet.nats.server import free_port
from lorafleet.ops.cluster import ClusterError, LocalCluster
from lorafleet.tune.analysis import plateaued
from lorafleet.tune.config import GenerativeTuneConfig, TuneError
from lorafleet.tune.generation_guard import GenerationDev, Messages, chosen_precision, generation_guard
from lorafleet.tune.precision import PrecisionQuality, candidate_precisions
from lorafleet.tune.probe import SERVED_NAME, PeakMemory, load_texts
from lorafleet.tune.report import machine
from lorafleet.tune.source import TuneSource
from lorafleet.tune.streamload import StreamResult, stream_closed_loop

Say = Callable[[str], None]
Options = dict[str, Any]
DEFAULT_MAX_LORAS = 4  # the vllm runtime's own default (VllmOptions.max_loras): the baseline starts there


def served_adapters(adapters: int) -> list[tuple[str, str]]:
    """(served name, adapter id) of each adapter id in the load; the first is the specialist's own."""
    return [(SERVED_NAME, f"{SERVED_NAME}-adapter")] + [(f"{SERVED_NAME}-{i}", f"{SERVED_NAME}-adapter-{i}")
                                                        for i in range(1, adapters)]


def max_loras_candidates(cfg: GenerativeTuneConfig) -> list[int]:
    """max_loras values worth a profile: more slots than adapters in the load would measure nothing new."""
    return sorted({v for v in cfg.max_loras_grid if v <= cfg.adapters}) if cfg.adapters > 1 else []


def cpu_loras_candidates(cfg: GenerativeTuneConfig, max_loras: int) -> list[int]:
    """max_cpu_loras values for a max_loras: each share of the adapters in the load, at least max_loras
    (vLLM refuses fewer)."""
    if cfg.adapters <= 1:
        return []
    return sorted({max(max_loras, round(share * cfg.adapters)) for share in cfg.cpu_loras_grid})


def planned_profiles(cfg: GenerativeTuneConfig, cuda: bool) -> int:
    """At most how many profiles the sweep measures (the stages' grids, capped by `max_profiles`): the n of the
    `profile i/≤n` lines. A stage can stop early (a plateau, the budget) or repeat a profile, so it is a bound."""
    cpu = len(cpu_loras_candidates(cfg, min(cfg.adapters, DEFAULT_MAX_LORAS)))
    memory = cfg.gpu_memory_grid if cuda else cfg.kv_cache_gib_grid
    stages = (1 + len(cfg.seqs_grid) + len(max_loras_candidates(cfg)) + cpu + len(cfg.batched_tokens_grid)
              + len(memory) + len(cfg.slots_grid))
    return max(1, min(stages, cfg.max_profiles))


def normalise(options: Options) -> Options:
    """One spelling per engine: no None values, and no max_cpu_loras at or below max_loras (vLLM's default
    is max_loras, and less is refused), so equal engines are measured once."""
    out = {k: v for k, v in options.items() if v is not None}
    if out.get("max_cpu_loras", 0) <= out.get("max_loras", DEFAULT_MAX_LORAS):
        out.pop("max_cpu_loras", None)
    return out


def explicit(options: Options) -> Options:
    """The recommended options with both adapter-cache sizes spelled out, for the fleet file."""
    loras = options.get("max_loras", DEFAULT_MAX_LORAS)
    return {**options, "max_loras": loras, "max_cpu_loras": options.get("max_cpu_loras") or loras}


@dataclass
class GenerativeResult:
    options: Options
    phase: str
    tokens_per_s: float  # best over the concurrencies
    ttft_p50_ms: float | None  # at the highest concurrency
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    peak_rss_mb: float
    errors: int = 0
    restart_s: float = 0.0
    points: list[dict[str, Any]] = field(default_factory=list)
    recommended: bool = False

    def key(self) -> tuple[Any, ...]:
        return tuple(sorted(self.options.items()))

    def row(self) -> dict[str, Any]:
        return {"phase": self.phase, **self.options, "output_tokens_per_s": round(self.tokens_per_s, 2),
                "ttft_p50_ms": self.ttft_p50_ms, "ttft_p99_ms": self.ttft_p99_ms, "itl_p50_ms": self.itl_p50_ms,
                "itl_p99_ms": self.itl_p99_ms, "peak_rss_mb": round(self.peak_rss_mb, 1), "errors": self.errors,
                "restart_s": round(self.restart_s, 1), "recommended": self.recommended}


@dataclass
class GenerativeTuneResult:
    out_dir: Path
    options: Options  # recommended engine options for the base
    meets_slo: bool
    reason: str
    results: list[GenerativeResult]
    baseline_tokens_per_s: float
    wall_s: float
    files: dict[str, Path] = field(default_factory=dict)
    # A bundle's own profile: its batching unchanged, its precision the one the guard judged (what shipping
    # records as the bundle's `precision`, and what a base under `precision: auto` serves it at).
    profile: ServingProfile = field(default_factory=ServingProfile)
    # The precision guard's verdicts (generation_guard.py: dev ROUGE-L per precision), as TuneResult has them.
    quality: list[PrecisionQuality] = field(default_factory=list)

    @property
    def recommended(self) -> GenerativeResult:
        return next(r for r in self.results if r.recommended)


def is_generative(source: TuneSource) -> bool:
    """Whether an adapter belongs to a causal LM (peft's task type), so the generative sweep applies."""
    try:
        config = json.loads((source.adapter_dir / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("task_type") == "CAUSAL_LM"


def recommend(results: list[GenerativeResult], slo_ms: float, memory_mb: float | None
              ) -> tuple[GenerativeResult, bool, str] | None:
    """Highest output tokens/s with TTFT p99 within the objective (and memory); else the lowest TTFT p99."""
    valid = [r for r in results if r.errors == 0 and r.ttft_p99_ms is not None]
    if not valid:
        return None
    fits = [r for r in valid if r.ttft_p99_ms <= slo_ms and (memory_mb is None or r.peak_rss_mb <= memory_mb)]  # type: ignore[operator]
    if fits:
        return max(fits, key=lambda r: r.tokens_per_s), True, f"highest output tokens/s with TTFT p99 ≤ {slo_ms:g} ms"
    best = min(valid, key=lambda r: r.ttft_p99_ms)  # type: ignore[arg-type, return-value]
    return best, False, f"no profile met TTFT p99 ≤ {slo_ms:g} ms; this one has the lowest"


class GenerativeSweeper:
    def __init__(self, source: TuneSource, cfg: GenerativeTuneConfig, work_dir: Path, say: Say) -> None:
        self.source, self.cfg, self.work_dir, self.say = source, cfg, work_dir, say
        self.cluster: LocalCluster | None = None
        self.texts = [f"Write a short heading for this sentence: {t}" for t in load_texts(seed=cfg.seed)]
        try:
            rank = int(json.loads((source.adapter_dir / "adapter_config.json").read_text()).get("r", 16))
        except (OSError, ValueError, TypeError):
            rank = 16
        self.fixed: Options = {"max_model_len": cfg.max_model_len, "max_lora_rank": max(rank, 8)}
        self.names = [name for name, _ in served_adapters(cfg.adapters)]
        self.precision = FP32  # the base's precision in the tuning fleet: the guard's, then the judged one

    def fleet(self, options: Options) -> FleetConfig:
        base = self.source.base_name
        return FleetConfig(
            bases=[BaseModelSpec(name=base, source=self.source.base_source, revision=self.source.base_revision,
                                 runtime="vllm", precision=self.precision, options={**self.fixed, **options})],
            models=[ServedModel(name=name, base=base, adapter=str(self.source.adapter_dir), adapter_id=adapter_id)
                    for name, adapter_id in served_adapters(self.cfg.adapters)],
            gateway=GatewayConfig(port=0, default_deadline_s=300.0, max_deadline_s=600.0, admit_fraction=None),
            worker=WorkerConfig(device=self.cfg.device),
        )

    def start(self, options: Options) -> None:
        self.cluster = LocalCluster(self.fleet(options), workers=1, port=0, home=self.work_dir / "cluster",
                                    nats_port=free_port())
        try:
            self.cluster.start(timeout=600)
        except ClusterError as exc:
            raise TuneError(f"the tuning cluster did not start: {exc}") from exc
        self._wait_serving(300)

    def apply(self, options: Options) -> float:
        assert self.cluster is not None
        t0 = time.monotonic()
        self.cluster.restart_worker("worker-1", self.fleet(options))
        self.cluster.wait_ready(timeout=600)
        self._wait_serving(300)
        return time.monotonic() - t0

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    def _body(self, i: int) -> dict[str, Any]:
        return {"model": self.names[i % len(self.names)],
                "messages": [{"role": "user", "content": self.texts[i % len(self.texts)]}],
                "max_tokens": self.cfg.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}

    def _wait_serving(self, timeout: float) -> None:
        """Until every adapter id of the load has answered once (each is loaded then, before any measurement)."""
        assert self.cluster is not None
        deadline, last = time.monotonic() + timeout, ""
        for i, name in enumerate(self.names):
            body = {**self._body(i), "stream": False, "max_tokens": 2}
            body.pop("stream_options")
            while True:
                try:
                    r = httpx.post(f"{self.cluster.gateway_url}/v1/chat/completions", json=body, timeout=60)
                    if r.status_code == 200:
                        break
                    last = f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as exc:
                    last = str(exc)
                if time.monotonic() > deadline:
                    raise TuneError(f"the tuning worker did not serve adapter {name} within {timeout:.0f}s ({last})")
                time.sleep(0.5)

    def generate(self, prompts: list[Messages], max_tokens: int) -> list[str]:
        """Greedy answers of the specialist's own adapter to `prompts` through the gateway (the served path)."""
        assert self.cluster is not None
        url = f"{self.cluster.gateway_url}/v1/chat/completions"

        def one(messages: Messages) -> str:
            r = httpx.post(url, json={"model": self.names[0], "messages": messages, "max_tokens": max_tokens,
                                      "temperature": 0}, timeout=600)
            if r.status_code != 200:
                raise TuneError(f"the tuning gateway answered HTTP {r.status_code}: {r.text[:300]}")
            return str(r.json()["choices"][0]["message"]["content"])

        with ThreadPoolExecutor(self.cfg.guard_concurrency) as pool:
            return list(pool.map(one, prompts))

    def measure(self, options: Options, phase: str, restart_s: float) -> GenerativeResult:
        assert self.cluster is not None
        host, port = self.cluster.gateway_url.removeprefix("http://").split(":")
        cfg = self.cfg
        top = max(cfg.concurrencies)
        points: list[StreamResult] = []
        with PeakMemory(self.cluster.pid("worker-1")) as mem:
            if cfg.warmup_s:
                asyncio.run(stream_closed_loop(host, int(port), "/v1/chat/completions", self._body, top, cfg.warmup_s))
            for c in cfg.concurrencies:
                points.append(asyncio.run(stream_closed_loop(host, int(port), "/v1/chat/completions", self._body, c,
                                                             cfg.point_s)))
        last = next(p for p in points if p.level == top).summary()
        return GenerativeResult(options=options, phase=phase, tokens_per_s=max(p.tokens_per_s for p in points),
                                ttft_p50_ms=last["ttft_p50_ms"], ttft_p99_ms=last["ttft_p99_ms"],
                                itl_p50_ms=last["itl_p50_ms"], itl_p99_ms=last["itl_p99_ms"],
                                peak_rss_mb=mem.peak_rss / 2**20, errors=sum(p.errors for p in points),
                                restart_s=restart_s, points=[p.summary() for p in points])


def judge_precisions(sweeper: GenerativeSweeper, source: TuneSource, cfg: GenerativeTuneConfig, options: Options,
                     say: Say) -> list[PrecisionQuality]:
    """The guard (generation_guard.py) on the running tuning cluster: the worker restarted at each candidate
    precision, the dev prompts answered through the gateway. Candidates: what the vllm runtime supports on the
    device, among `cfg.precisions`; the worker is left at the last precision generated."""
    from lorafleet.models.device import resolve_device

    device = resolve_device(cfg.device)
    supported = plugins.load(plugins.RUNTIMES, "vllm").precisions(device)
    measure, rejected = candidate_precisions(cfg.precisions, supported)
    dev: GenerationDev | None = source.generation
    if measure != [FP32]:
        say(f"  precision guard on {device}: {', '.join(measure)} against fp32 on "
            + (f"{len(dev.prompts)} dev prompts ({dev.metric})" if dev is not None else "no dev set: fp32 only"))

    def generator_at(precision: str) -> Callable[[list[Messages]], list[str]]:
        if precision != sweeper.precision:
            sweeper.precision = precision
            sweeper.apply(normalise(options))
        return lambda prompts: sweeper.generate(prompts, dev.max_tokens if dev is not None else cfg.max_tokens)

    verdicts = generation_guard(measure, generator_at, dev, max_loss=cfg.precision_max_loss)
    for v in [*verdicts, *rejected]:
        say(f"    {v.precision:>4}: {'qualifies' if v.qualified else 'disqualified'} — {v.reason}")
    return [*verdicts, *rejected]


def run_generative_tune(source: TuneSource, cfg: GenerativeTuneConfig | None = None, out_dir: Path | None = None,
                        say: Say | None = None) -> GenerativeTuneResult:
    cfg = cfg or GenerativeTuneConfig()
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(out_dir) if out_dir else settings.home() / "tune" / f"{source.label}-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / ".work"
    t0 = time.monotonic()
    from lorafleet.models.device import resolve_device

    cuda = resolve_device(cfg.device).startswith("cuda")
    default: Options = {"max_num_seqs": 32, "max_loras": min(cfg.adapters, DEFAULT_MAX_LORAS)}
    sweeper = GenerativeSweeper(source, cfg, work, say)
    results: list[GenerativeResult] = []
    memory_mb = cfg.memory_gb * 1024 if cfg.memory_gb else None
    at_most = planned_profiles(cfg, cuda)
    say(f"tune (generative): {source.label} on {source.base_name}; TTFT p99 ≤ {cfg.slo_ttft_p99_ms:g} ms; "
        f"{cfg.adapters} adapter id(s) in the load; budget {cfg.budget_s:.0f}s; each profile restarts the engine")

    def run_one(options: Options, phase: str, first: bool = False) -> GenerativeResult | None:
        options = normalise(options)
        key = tuple(sorted(options.items()))
        if any(r.key() == key for r in results):
            return next(r for r in results if r.key() == key)
        if not first and (len(results) >= cfg.max_profiles or time.monotonic() - t0 > cfg.budget_s):
            return None
        # Announced before it runs: each profile restarts the engine and measures for a minute or more.
        say(f"  profile {len(results) + 1}/≤{at_most} ({phase}): {options} …")
        restart = 0.0 if first else sweeper.apply(options)
        r = sweeper.measure(options, phase, restart)
        results.append(r)
        say(f"  [{len(results):>2}/{at_most}] {options}: {r.tokens_per_s:6.1f} tok/s, TTFT p50 {r.ttft_p50_ms} p99 "
            f"{r.ttft_p99_ms} ms, ITL p50 {r.itl_p50_ms} ms, RSS {r.peak_rss_mb:.0f} MB"
            + (f", {r.errors} errors" if r.errors else "") + f"  ({time.monotonic() - t0:.0f}s)")
        return r

    def centre() -> Options:
        fit = recommend(results, cfg.slo_ttft_p99_ms, memory_mb)
        return dict(fit[0].options) if fit else dict(default)

    ok = False
    try:
        say("  starting a private cluster (nats-server, gateway, one worker with a vLLM engine)…")
        sweeper.start(default)
        quality = judge_precisions(sweeper, source, cfg, default, say)
        precision = chosen_precision(quality)
        if sweeper.precision != precision:  # the guard left the worker at its last candidate: back to the judged one
            sweeper.precision = precision
            sweeper.apply(normalise(default))
        run_one(default, "baseline", first=True)
        history: list[float] = []
        for seqs in cfg.seqs_grid:
            r = run_one({**default, "max_num_seqs": seqs}, "seqs")
            if r is None:
                break
            history.append(r.tokens_per_s)
            if plateaued(history, cfg.plateau_gain, 1):
                break
        # The adapter caches next: with several adapters in rotation they decide how often a sequence waits
        # for a LoRA slot (max_loras) or for its adapter to be read from disk again (max_cpu_loras).
        for loras in max_loras_candidates(cfg):
            run_one({**centre(), "max_loras": loras}, "max_loras")
        c = centre()
        for cpu in cpu_loras_candidates(cfg, c.get("max_loras", DEFAULT_MAX_LORAS)):
            run_one({**c, "max_cpu_loras": cpu}, "max_cpu_loras")
        for tokens in cfg.batched_tokens_grid:
            run_one({**centre(), "max_num_batched_tokens": tokens}, "batched_tokens")
        for memory in (cfg.gpu_memory_grid if cuda else cfg.kv_cache_gib_grid):
            run_one({**centre(), ("gpu_memory_utilization" if cuda else "kv_cache_gib"): memory}, "memory")
        for share in cfg.slots_grid:
            c = centre()
            run_one({**c, "slots": max(1, round(share * c["max_num_seqs"]))}, "slots")
        ok = True
    finally:
        sweeper.stop()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
    picked = recommend(results, cfg.slo_ttft_p99_ms, memory_mb)
    if picked is None:
        raise TuneError(f"no profile could be measured without errors; see the logs under {work / 'cluster' / 'logs'}")
    best, meets, reason = picked
    best.recommended = True
    result = GenerativeTuneResult(out_dir, explicit({**sweeper.fixed, **best.options}), meets, reason, results,
                                  results[0].tokens_per_s, time.monotonic() - t0,
                                  profile=ServingProfile(precision=precision), quality=quality)
    result.files = write_generative_outputs(result, cfg, source)
    say(f"recommended options for base {source.base_name}: {result.options} — {reason}: {best.tokens_per_s:.1f} "
        f"tok/s, TTFT p99 {best.ttft_p99_ms} ms; outputs in {out_dir} ({result.wall_s:.0f}s)")
    return result


def write_generative_outputs(result: GenerativeTuneResult, cfg: GenerativeTuneConfig, source: TuneSource
                             ) -> dict[str, Path]:
    out = result.out_dir
    files = {"profile": out / "profile.yaml", "csv": out / "results.csv", "json": out / "results.json",
             "plot": out / "tokens_ttft.png"}
    best = result.recommended
    when = time.strftime("%Y-%m-%d %H:%M")
    header = (f"# lorafleet tune (generative): {source.label} on {source.base_name}, {when}\n"
              f"# {result.reason}: {best.tokens_per_s:.1f} output tok/s, TTFT p99 {best.ttft_p99_ms} ms at "
              f"concurrency {max(cfg.concurrencies)}, {cfg.adapters} adapter id(s) in the load\n"
              "# engine options of the base: put them under bases[].options (runtime: vllm) in the fleet file;\n"
              "# max_cpu_loras is also how many adapters a worker keeps loaded on that base\n"
              f"# judged at {result.profile.precision or FP32} by the quality guard (precisions.csv), measured at it; "
              "`precision: auto` on the base serves it so\n")
    files["profile"].write_text(header + yaml.safe_dump({"runtime": "vllm", "options": result.options},
                                                        sort_keys=False))
    rows = [r.row() for r in result.results]
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(files["csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    files["json"].write_text(json.dumps({
        "source": {"label": source.label, "adapter_dir": str(source.adapter_dir), "base": source.base_name,
                   "base_source": source.base_source},
        "config": cfg.model_dump(mode="json"), "machine": machine(), "recommended": {
            "options": result.options, "meets_slo": result.meets_slo, "reason": result.reason, **best.row()},
        "baseline_tokens_per_s": round(result.baseline_tokens_per_s, 2),
        "profiles": [{**r.row(), "points": r.points} for r in result.results], "wall_s": round(result.wall_s, 1),
        "precision": result.profile.precision, "precisions": [q.row() for q in result.quality],
    }, indent=2))
    files["precisions"] = out / "precisions.csv"
    prows = [q.row() for q in result.quality]
    with open(files["precisions"], "w", newline="") as fh:
        pwriter = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for row in prows for k in row)) or ["precision"])
        pwriter.writeheader()
        pwriter.writerows(prows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for r in result.results:
        if r.ttft_p99_ms is not None:
            ax.scatter(r.ttft_p99_ms, r.tokens_per_s, color="tab:red" if r.recommended else "tab:blue")
            loras = f" loras {r.options['max_loras']}/{r.options.get('max_cpu_loras', r.options['max_loras'])}" \
                if "max_loras" in r.options else ""
            ax.annotate(f"seqs {r.options.get('max_num_seqs')}{loras}", (r.ttft_p99_ms, r.tokens_per_s), fontsize=7)
    ax.axvline(cfg.slo_ttft_p99_ms, color="grey", linestyle="--", label="TTFT p99 objective")
    ax.set_xlabel(f"TTFT p99 (ms) at concurrency {max(cfg.concurrencies)}")
    ax.set_ylabel("output tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(files["plot"], dpi=110)
    plt.close(fig)
    return files
