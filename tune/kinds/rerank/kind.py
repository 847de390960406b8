"""The rerank kind's sweep: the score profile of a cross-encoder's LoRA under rerank requests.

A reranker's unit of work is a (query, document) pair, and its typical request is one query with the
first stage's top k documents: the load is `/v1/rerank` with 1 query × `rerank_documents` (50)
passages of the statutes (load.py), and every profile reports pairs/s (requests/s × documents) beside the
request p99 (all of a request's pairs scored) at the same offered rates.

The knobs are the embedding sweep's, in the order that matters for pairs: the token budget first
(`max_batch_tokens`: padded pair tokens of one forward pass, so it sets pairs per call, and of one
batch), then batch items (tasks, each a chunk of `gateway.rerank_chunk` documents, one batch may
join), then the wait window. The cross-encoder runtime serves fp32 only, so the precision guard has
nothing to judge: fp32 is the reference and the only candidate.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from lorafleet.core.config import BaseModelSpec, GatewayConfig, ServingProfile
from lorafleet.tune.analysis import ProfileResult, plateaued
from lorafleet.tune.batching import BatchingSweep, Sweeper, TuneResult
from lorafleet.tune.config import TuneConfig
from lorafleet.tune.kind import Say, TuneKind
from lorafleet.tune.kinds.rerank.load import rerank_bodies, rerank_target
from lorafleet.tune.loadgen import Target
from lorafleet.tune.precision import PrecisionQuality
from lorafleet.tune.source import TuneSource
from lorafleet.tune.sweep import Sweep

SCORE_TASK_TYPE = "SEQ_CLS"  # peft's task type of a cross-encoder LoRA (what the rerank kind trains)
RUNTIME = "cross-encoder"


def is_score(source: TuneSource) -> bool:
    """Whether an adapter belongs to a cross-encoder (peft task type SEQ_CLS), so the score sweep applies."""
    return RerankTune().claims(source)


class ScoreSweeper(Sweeper):
    """The embedding sweeper with a cross-encoder base and rerank requests as the load."""

    def __init__(self, source: TuneSource, cfg: TuneConfig, work_dir: Path, say: Say) -> None:
        # Closed-loop points at the rerank concurrencies; the rest of the machinery reads cfg.concurrencies.
        super().__init__(source, cfg.model_copy(update={"concurrencies": cfg.rerank_concurrencies}), work_dir, say)
        self.bodies = rerank_bodies(self.texts, cfg.rerank_documents, seed=cfg.seed)

    def base(self, profile: ServingProfile) -> BaseModelSpec:
        return BaseModelSpec(name=self.source.base_name, source=self.source.base_source,
                             revision=self.source.base_revision, runtime=RUNTIME, precision="fp32")

    def gateway(self) -> GatewayConfig:
        return GatewayConfig(port=0, default_deadline_s=60.0, max_rerank_documents=max(self.cfg.rerank_documents, 1000))

    def target(self) -> Target:
        assert self.cluster is not None
        return rerank_target(self.cluster.gateway_url, self.bodies)

    def ready_request(self) -> tuple[str, bytes, str]:
        """A rerank request: the (new) worker loaded base, adapter and head once it is answered."""
        return "/v1/rerank", self.bodies[0], "application/json"

    def measure(self, profile: ServingProfile, phase: str, restart_s: float) -> ProfileResult:
        r = super().measure(profile, phase, restart_s)
        r.pairs_per_request = self.cfg.rerank_documents
        return r

    def calibrate(self, target: Target, measured: float) -> None:
        super().calibrate(target, measured)
        # A 50-pair request takes a CPU worker a good part of a second: the embedding sweep's floor of 1 req/s
        # could offer more than the capacity. Rates here follow the measured capacity down to 0.1 req/s.
        self.open_rates = [round(max(f * self.baseline_rps, 0.1), 2) for f in self.cfg.open_fractions]


class RerankSweep(BatchingSweep):
    starting: ClassVar[str] = "a private cluster (nats-server, gateway, one cross-encoder worker)"

    def make_probe(self) -> ScoreSweeper:
        return ScoreSweeper(self.source, self.cfg, self.work_dir, self.say)

    @property
    def slo(self) -> float:
        return self.cfg.slo_rerank_p99_ms

    def intro(self) -> str:
        cfg = self.cfg
        return (f"tune (reranker): {self.source.label} on {self.source.base_name}; 1 query × {cfg.rerank_documents} "
                f"documents per request; request p99 ≤ {self.slo:g} ms"
                + (f", memory ≤ {cfg.memory_gb:g} GiB" if cfg.memory_gb else "") + f"; budget {cfg.budget_s:.0f}s")

    def guard(self, start: Callable[[], None]) -> list[PrecisionQuality]:
        start()
        return [PrecisionQuality("fp32", True, "the reference (the cross-encoder runtime serves fp32 only)")]

    def planned(self, quality: list[PrecisionQuality]) -> int:
        cfg = self.cfg
        return min(cfg.max_profiles, 1 + len(cfg.rerank_tokens_grid) + len(cfg.rerank_items_grid) + len(cfg.wait_grid))

    def line(self, result: ProfileResult) -> str:
        p = result.profile
        return (f"items {p.max_batch_items:>3} tokens {p.max_batch_tokens:>5} wait {p.max_wait_ms:>4g} ms: "
                f"{result.pairs_per_s or 0:7.1f} pairs/s ({result.throughput_rps:.2f} req/s), request "
                f"{self.latency(result)}")

    def grid(self, sweep: Sweep) -> None:
        cfg, results = self.cfg, sweep.results
        # The token budget first: it decides pairs per forward pass, the knob that matters most for pairs/s.
        history: list[float] = []
        for tokens in cfg.rerank_tokens_grid:
            r = sweep.trial(self.centre(results).model_copy(update={"max_batch_tokens": tokens}), "tokens")
            if r is None:
                break
            history.append(r.throughput_rps)
            if plateaued(history, cfg.plateau_gain, cfg.plateau_patience):
                break
        for items in cfg.rerank_items_grid:
            sweep.trial(self.centre(results).model_copy(update={"max_batch_items": items}), "items")
        for wait in cfg.wait_grid:
            sweep.trial(self.centre(results).model_copy(update={"max_wait_ms": wait}), "wait")

    def done(self, result: TuneResult) -> str:
        rec = result.recommendation.result
        return (f"recommended: {rec.profile.model_dump()} — {result.recommendation.reason}: {rec.pairs_per_s:.1f} "
                f"pairs/s ({rec.throughput_rps:.2f} req/s of {self.cfg.rerank_documents} documents), request p99 "
                f"{rec.p99_ms:.0f} ms; outputs in {result.out_dir} ({result.wall_s:.0f}s)")


class RerankTune(TuneKind):
    """A cross-encoder's LoRA (peft SEQ_CLS): rerank requests, pairs/s."""

    name: ClassVar[str] = "rerank"
    task_types: ClassVar[frozenset[str | None]] = frozenset({SCORE_TASK_TYPE})

    def sweep(self, source: TuneSource, cfg: TuneConfig, work_dir: Path, say: Say) -> RerankSweep:
        return RerankSweep(source, cfg, work_dir, say)
