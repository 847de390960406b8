"""The generation kind's sweep: the engine options of a generative specialist's base, on a private cluster.

An engine batches continuously, so the embedding sweep's knobs (batch items, wait window) do not
apply; what decides its throughput and latency are the engine's options, swept here in the same
staged, coordinate-wise way (see tune/sweep.py for why a staged grid and not a sampler): `max_num_seqs`
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
(tune/generation_guard.py); every profile is then measured at the fastest qualifying one, which the result's profile (so
the bundle) records and a base under `precision: auto` serves.

The engine's options belong to its base (one engine serves every adapter of a base), so the result
is a set of `bases[].options` for the fleet file (profile.yaml), not a bundle's batching profile; the
adapter-cache sizes among them too. The worker keeps as many adapters registered on the engine as the
engine caches in host memory (`VllmRuntime.adapter_capacity`, i.e. max_cpu_loras), so max_cpu_loras is
also the worker's adapter bound on that base.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from lorafleet.core import plugins
from lorafleet.core.config import ServingProfile
from lorafleet.models.precision import FP32
from lorafleet.tune.analysis import plateaued
from lorafleet.tune.config import GenerativeTuneConfig, TuneConfig, TuneError
from lorafleet.tune.generation_guard import GenerationDev, Messages, chosen_precision, generation_guard
from lorafleet.tune.kind import KindSweep, Say, TuneKind
from lorafleet.tune.kinds.generation.outputs import write_generative_outputs
from lorafleet.tune.kinds.generation.probe import GenerativeSweeper
from lorafleet.tune.kinds.generation.result import (
    DEFAULT_MAX_LORAS,
    GenerativeResult,
    GenerativeTuneResult,
    Options,
    cpu_loras_candidates,
    explicit,
    max_loras_candidates,
    normalise,
    planned_profiles,
    recommend,
)
from lorafleet.tune.precision import PrecisionQuality, candidate_precisions
from lorafleet.tune.source import TuneSource
from lorafleet.tune.sweep import Sweep, drive, out_folder


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


class GenerationSweep(KindSweep):
    starting: ClassVar[str] = "a private cluster (nats-server, gateway, one worker with a vLLM engine)"
    cfg: GenerativeTuneConfig
    probe: GenerativeSweeper

    def __init__(self, source: TuneSource, cfg: GenerativeTuneConfig, work_dir: Path, say: Say) -> None:
        from lorafleet.models.device import resolve_device

        super().__init__(source, cfg, work_dir, say)
        self.cuda = resolve_device(cfg.device).startswith("cuda")
        self.memory_mb = cfg.memory_gb * 1024 if cfg.memory_gb else None
        self.precision = FP32

    def make_probe(self) -> GenerativeSweeper:
        return GenerativeSweeper(self.source, self.cfg, self.work_dir, self.say)

    def intro(self) -> str:
        cfg = self.cfg
        return (f"tune (generative): {self.source.label} on {self.source.base_name}; TTFT p99 ≤ "
                f"{cfg.slo_ttft_p99_ms:g} ms; {cfg.adapters} adapter id(s) in the load; budget {cfg.budget_s:.0f}s; "
                "each profile restarts the engine")

    def default(self) -> Options:
        return {"max_num_seqs": 32, "max_loras": min(self.cfg.adapters, DEFAULT_MAX_LORAS)}

    def normalise(self, candidate: Any) -> Options:
        return normalise(candidate)

    def planned(self, quality: list[PrecisionQuality]) -> int:
        return planned_profiles(self.cfg, self.cuda)

    def guard(self, start: Callable[[], None]) -> list[PrecisionQuality]:
        """On the served path: the cluster starts first, then each precision answers the dev prompts."""
        start()
        quality = judge_precisions(self.probe, self.source, self.cfg, self.default(), self.say)
        self.precision = chosen_precision(quality)
        if self.probe.precision != self.precision:  # the guard left the worker at its last candidate
            self.probe.precision = self.precision
            self.probe.apply(normalise(self.default()))
        return quality

    def line(self, result: GenerativeResult) -> str:
        r = result
        return (f"{r.options}: {r.tokens_per_s:6.1f} tok/s, TTFT p50 {r.ttft_p50_ms} p99 {r.ttft_p99_ms} ms, ITL p50 "
                f"{r.itl_p50_ms} ms, RSS {r.peak_rss_mb:.0f} MB" + (f", {r.errors} errors" if r.errors else ""))

    def centre(self, results: list[GenerativeResult]) -> Options:
        fit = recommend(results, self.cfg.slo_ttft_p99_ms, self.memory_mb)
        return dict(fit[0].options) if fit else self.default()

    def grid(self, sweep: Sweep) -> None:
        cfg, results = self.cfg, sweep.results
        history: list[float] = []
        for seqs in cfg.seqs_grid:
            r = sweep.trial({**self.default(), "max_num_seqs": seqs}, "seqs")
            if r is None:
                break
            history.append(r.tokens_per_s)
            if plateaued(history, cfg.plateau_gain, 1):
                break
        # The adapter caches next: with several adapters in rotation they decide how often a sequence waits
        # for a LoRA slot (max_loras) or for its adapter to be read from disk again (max_cpu_loras).
        for loras in max_loras_candidates(cfg):
            sweep.trial({**self.centre(results), "max_loras": loras}, "max_loras")
        c = self.centre(results)
        for cpu in cpu_loras_candidates(cfg, c.get("max_loras", DEFAULT_MAX_LORAS)):
            sweep.trial({**c, "max_cpu_loras": cpu}, "max_cpu_loras")
        for tokens in cfg.batched_tokens_grid:
            sweep.trial({**self.centre(results), "max_num_batched_tokens": tokens}, "batched_tokens")
        for memory in (cfg.gpu_memory_grid if self.cuda else cfg.kv_cache_gib_grid):
            key = "gpu_memory_utilization" if self.cuda else "kv_cache_gib"
            sweep.trial({**self.centre(results), key: memory}, "memory")
        for share in cfg.slots_grid:
            c = self.centre(results)
            sweep.trial({**c, "slots": max(1, round(share * c["max_num_seqs"]))}, "slots")

    def finish(self, results: list[GenerativeResult], quality: list[PrecisionQuality], out_dir: Path,
               wall_s: float) -> GenerativeTuneResult:
        picked = recommend(results, self.cfg.slo_ttft_p99_ms, self.memory_mb)
        if picked is None:
            raise TuneError("no profile could be measured without errors; see the logs under "
                            f"{self.work_dir / 'cluster' / 'logs'}")
        best, meets, reason = picked
        best.recommended = True
        result = GenerativeTuneResult(out_dir, explicit({**self.probe.fixed, **best.options}), meets, reason, results,
                                      results[0].tokens_per_s, wall_s, profile=ServingProfile(precision=self.precision),
                                      quality=quality)
        result.files = write_generative_outputs(result, self.cfg, self.source)
        return result

    def done(self, result: GenerativeTuneResult) -> str:
        best = result.recommended
        return (f"recommended options for base {self.source.base_name}: {result.options} — {result.reason}: "
                f"{best.tokens_per_s:.1f} tok/s, TTFT p99 {best.ttft_p99_ms} ms; outputs in {result.out_dir} "
                f"({result.wall_s:.0f}s)")


class GenerationTune(TuneKind):
    """A causal LM's LoRA (peft CAUSAL_LM): the engine options of its base."""

    name: ClassVar[str] = "generation"
    task_types: ClassVar[frozenset[str | None]] = frozenset({"CAUSAL_LM"})

    def config(self, cfg: TuneConfig, generative: GenerativeTuneConfig | None) -> GenerativeTuneConfig:
        """`generative` as given, else its quick preset or defaults with the common config's limits."""
        if generative is not None:
            return generative
        base = GenerativeTuneConfig.quick_preset() if cfg.quick else GenerativeTuneConfig()
        return base.model_copy(update={"memory_gb": cfg.memory_gb, "device": cfg.device,
                                       "slo_ttft_p99_ms": cfg.slo_ttft_p99_ms,
                                       "precision_max_loss": cfg.precision_max_loss})

    def sweep(self, source: TuneSource, cfg: GenerativeTuneConfig, work_dir: Path, say: Say) -> GenerationSweep:
        return GenerationSweep(source, cfg, work_dir, say)


def is_generative(source: TuneSource) -> bool:
    """Whether an adapter belongs to a causal LM (peft's task type), so the generative sweep applies."""
    return GenerationTune().claims(source)


def run_generative_tune(source: TuneSource, cfg: GenerativeTuneConfig | None = None, out_dir: Path | None = None,
                        say: Say | None = None) -> GenerativeTuneResult:
    """The generation kind's sweep of `source` through the one driver, whatever the adapter's task type."""
    import sys

    cfg = cfg or GenerativeTuneConfig()
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    return drive(lambda work, say_: GenerationSweep(source, cfg, work, say_), cfg.budget_s,
                 out_folder(source, out_dir), say)
