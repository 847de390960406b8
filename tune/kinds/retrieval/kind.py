"""The retrieval kind's sweep: an embedding LoRA's batching profile under /v1/encode load, precision an axis.

Knobs in the order that matters: batch items ascending until throughput plateaus, then the wait window, batches
in flight and the token budget around the best so far; last, each precision the guard (precision.py: nDCG@10 and
cosine against fp32, in this process, before the cluster starts) qualifies, on the best fp32 profiles.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from lorafleet.core.config import ServingProfile
from lorafleet.tune.analysis import ProfileResult, plateaued, score
from lorafleet.tune.batching import BatchingSweep, Sweeper, TuneResult
from lorafleet.tune.config import TuneConfig
from lorafleet.tune.kind import Say, TuneKind
from lorafleet.tune.precision import PrecisionQuality, run_guard
from lorafleet.tune.source import TuneSource
from lorafleet.tune.sweep import Sweep


def _profile(items: int, tokens: int, wait: float, inflight: int) -> ServingProfile:
    return ServingProfile(max_batch_items=items, max_batch_tokens=max(tokens, items), max_wait_ms=wait,
                          batches_in_flight=inflight, precision="fp32")


class RetrievalSweep(BatchingSweep):
    def __init__(self, source: TuneSource, cfg: TuneConfig, work_dir: Path, say: Say) -> None:
        super().__init__(source, cfg, work_dir, say)
        self.faster: list[str] = []  # the qualifying precisions besides fp32 (the guard's)

    def make_probe(self) -> Sweeper:
        return Sweeper(self.source, self.cfg, self.work_dir, self.say)

    def intro(self) -> str:
        cfg = self.cfg
        return (f"tune: {self.source.label} on {self.source.base_name}; SLO p99 ≤ {cfg.slo_p99_ms:g} ms"
                + (f", memory ≤ {cfg.memory_gb:g} GiB" if cfg.memory_gb else "") + f"; budget {cfg.budget_s:.0f}s")

    def guard(self, start: Callable[[], None]) -> list[PrecisionQuality]:
        # Judged once each before any load; the qualifying ones then re-measure the best fp32 profiles.
        quality = run_guard(self.source, self.cfg, self.say)
        self.faster = [q.precision for q in quality if q.qualified and q.precision != "fp32"]
        start()
        return quality

    def cap(self, quality: list[PrecisionQuality]) -> int:
        """The staged stages' cap: the precision measurements are reserved out of max_profiles."""
        return self.cfg.max_profiles - self.reserved()

    def reserved(self) -> int:
        return min(len(self.faster) * self.cfg.precision_profiles, max(self.cfg.max_profiles - 2, 0))

    def planned(self, quality: list[PrecisionQuality]) -> int:
        cfg = self.cfg
        return min(self.cap(quality), 1 + len(cfg.items_grid) + len(cfg.wait_grid) + len(cfg.inflight_grid)
                   + len(cfg.tokens_per_item_grid)) + self.reserved()

    def line(self, result: ProfileResult) -> str:
        p = result.profile
        return (f"items {p.max_batch_items:>3} tokens {p.max_batch_tokens:>5} wait {p.max_wait_ms:>4g} ms in-flight "
                f"{p.batches_in_flight} {p.precision}: {result.throughput_rps:6.1f} req/s, {self.latency(result)}")

    def grid(self, sweep: Sweep) -> None:
        cfg, default, results = self.cfg, self.default(), sweep.results
        history: list[float] = []
        for items in cfg.items_grid:  # batch items, ascending, until throughput plateaus
            r = sweep.trial(_profile(items, default.max_batch_tokens, default.max_wait_ms,
                                     default.batches_in_flight), "items")
            if r is None:
                break
            history.append(r.throughput_rps)
            if plateaued(history, cfg.plateau_gain, cfg.plateau_patience):
                self.say(f"  throughput plateaued at {max(history):.1f} req/s; larger batches skipped")
                break
        for wait in cfg.wait_grid:
            sweep.trial(self.centre(results).model_copy(update={"max_wait_ms": wait}), "wait")
        for inflight in cfg.inflight_grid:
            sweep.trial(self.centre(results).model_copy(update={"batches_in_flight": inflight}), "in_flight")
        for per_item in cfg.tokens_per_item_grid:
            c = self.centre(results)
            sweep.trial(c.model_copy(update={"max_batch_tokens": c.max_batch_items * per_item}), "tokens")
        # Each qualifying precision on the best fp32 profiles (batch knobs barely interact with it).
        best = sorted(results, key=lambda r: score(r, cfg.slo_p99_ms, self.memory_mb), reverse=True)
        for p in self.faster:
            for r in best[: cfg.precision_profiles]:
                sweep.trial(r.profile.model_copy(update={"precision": p}), "precision", cap=cfg.max_profiles)

    def done(self, result: TuneResult) -> str:
        rec = result.recommendation
        return (f"recommended: {rec.result.profile.model_dump()} — {rec.reason}: {rec.result.throughput_rps:.1f} "
                f"req/s, p99 {rec.result.p99_ms:.0f} ms; outputs in {result.out_dir} ({result.wall_s:.0f}s)")


class RetrievalTune(TuneKind):
    """An embedding LoRA (peft FEATURE_EXTRACTION, or no task type recorded)."""

    name: ClassVar[str] = "retrieval"
    task_types: ClassVar[frozenset[str | None]] = frozenset({None, "FEATURE_EXTRACTION"})

    def sweep(self, source: TuneSource, cfg: TuneConfig, work_dir: Path, say: Say) -> RetrievalSweep:
        return RetrievalSweep(source, cfg, work_dir, say)
