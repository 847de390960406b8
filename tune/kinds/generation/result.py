"""The generation kind's candidates and results: engine options, their measurements, the recommendation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.core.config import ServingProfile
from lorafleet.tune.config import GenerativeTuneConfig
from lorafleet.tune.precision import PrecisionQuality
from lorafleet.tune.probe import SERVED_NAME

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
