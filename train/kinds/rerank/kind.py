"""The rerank task kind: `RerankKind` (registered as `rerank`, served by the `cross-encoder` runtime, capability
`score`), judged by the reranked first stage's nDCG@10 against the better of that first stage alone and the base
reranker; and its standalone run (`run_rerank_train`). Training is in `trainer`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from lorafleet.core.tasks import EpochCallback, MetricSpec, Rival, TrainResult
from lorafleet.models.device import resolve_device
from lorafleet.train.kinds.rerank.config import CE_BASE_SUFFIX, RerankConfig
from lorafleet.train.kinds.rerank.evaluate import FIRST, RerankDataset, pipeline_metrics, stage_key
from lorafleet.train.kinds.rerank.trainer import (
    BEST_FIRST,
    best_first_stage,
    build_rerank_dataset,
    load_adapter_reranker,
    rerank_baselines,
    train_reranker,
)
from lorafleet.train.kinds.retrieval.kind import RELEVANCE_NOTE, evaluation_data_key
from lorafleet.train.run import KindRun, LoopKind, run_kind, save_report


class RerankKind(LoopKind):
    """(query, document) → relevance, judged by the reranked first stage's nDCG@10."""

    name = "rerank"
    capability = "score"
    bundle_kind = "cross-encoder"
    default_runtime = "cross-encoder"
    metrics = MetricSpec(
        objective="dev_ndcg@10", direction="maximize", baseline=FIRST, baseline_label="first stage alone",
        label="nDCG@10 (reranked)", table=("test_ndcg@10", "base_test_ndcg@10", "first_test_ndcg@10", "dev_ndcg@10"),
        report=("ndcg@10", "mrr@10", "recall@1", "recall@10", "recall@depth"),
        # Against a BERT with a fresh head the base reranker is a straw man: the pipeline must beat the better of
        # it and its own first stage alone (`best_`, from `baselines` of the pipeline's own config), and the best
        # first stage alone of those its research space holds (`bestfirst_`, from `rivals`), in research's
        # verdict and at promotion.
        gate="best", gate_label="the better of its own first stage alone and the base reranker on it",
        rivals=(Rival(BEST_FIRST, "the best first stage alone (of those the search space holds)",
                      "best first stage alone"),),
        # Scores the reranker moves. Not recall@depth (the first stage's candidates: a deeper trial wins by depth
        # alone), nor recall@10/recall@100 (a reranker of the top k ≤ 10, or of any k ≤ 100, cannot change them).
        objectives=(("dev_mrr@10", "maximize"), ("dev_recall@1", "maximize")),
        notes=(RELEVANCE_NOTE,),
    )
    config_model = RerankConfig

    def dataset_key(self, cfg: RerankConfig) -> str:
        return super().dataset_key(cfg) + f"|{cfg.max_seq_length}"  # the corpus is chunked to it

    def baseline_key(self, cfg: RerankConfig) -> str:
        """The baselines are the config's own pipeline's: its evaluation data, the first stage and depth, and the
        cross-encoder base with its pair length."""
        s = cfg.first_stage
        return json.dumps([evaluation_data_key(cfg), list(stage_key(s)), s.depth, cfg.max_pair_length],
                          sort_keys=True, default=str)

    def rivals(self, cfg: RerankConfig, dataset: RerankDataset, variants: Sequence[RerankConfig]
               ) -> dict[str, float]:
        """`bestfirst_`: the best first stage alone among `cfg`'s and those of `variants` (the research space's), on
        `cfg`'s data."""
        return best_first_stage(cfg, dataset, [cfg.first_stage, *(v.first_stage for v in variants)])

    def base_name(self, cfg: RerankConfig) -> str:
        """The cross-encoder base of the fleet (`served_base`, else `<base name>-ce`): the embedder of the same
        checkpoint is another base, and promotion must find this one."""
        from lorafleet.core.model_source import base_name_for

        return cfg.served_base or f"{base_name_for(cfg.base_model)}{CE_BASE_SUFFIX}"

    def kind_run(self, cfg: RerankConfig) -> KindRun:
        return RerankRun(cfg)

    def evaluate(self, cfg: RerankConfig, dataset: RerankDataset, adapter_dir: Path, split: str) -> dict[str, float]:
        """The pipeline's `{split}_*` and, beside it, its own first stage alone (`first_{split}_*`): a winner whose
        first stage differs from the `train:` section's is compared with the right one."""
        device = resolve_device(cfg.device)
        model = load_adapter_reranker(cfg, Path(adapter_dir), device)
        return pipeline_metrics(model, dataset, cfg.first_stage, split, device=device, batch_size=cfg.eval_batch_size)

    def bundle_details(self, cfg: RerankConfig) -> dict[str, Any]:
        """The pair length the runtime truncates to, and the whole pipeline the adapter was trained and scored in."""
        s = cfg.first_stage
        return {"max_seq_length": cfg.max_pair_length,
                "pipeline": {"first_stage": s.kind, "embedder": s.embedder if s.kind != "bm25" else None,
                             "rrf_k": s.rrf_k if s.kind == "hybrid" else None, "depth": s.depth,
                             "chunk_tokens": cfg.max_seq_length, "section_score": "max over chunks",
                             "loss": cfg.loss}}


class RerankRun(KindRun):
    task: ClassVar[str] = "rerank"

    def build_dataset(self) -> RerankDataset:
        return build_rerank_dataset(self.cfg)

    def baselines(self, dataset: RerankDataset) -> dict[str, float]:
        return rerank_baselines(self.cfg, dataset)

    def train(self, dataset: RerankDataset, out: Path, on_epoch: EpochCallback | None, *,
              evaluate_test: bool) -> TrainResult:
        return train_reranker(self.cfg, dataset, out, on_epoch=on_epoch, evaluate_test=evaluate_test)

    def finish(self, result: TrainResult, dataset: RerankDataset, out: Path) -> None:
        result.extras.pop("groups", None)  # the training groups are for tests and the bench, not metrics.json

    def report(self, path: Path, dataset: RerankDataset, result: TrainResult) -> Path:
        return _write_report(path, self.cfg, result)

    def details(self, result: TrainResult, dataset: RerankDataset) -> dict[str, Any]:
        return {"pipeline": RerankKind().bundle_details(self.cfg)}


def run_rerank_train(cfg: RerankConfig, out_dir: Path | None = None, *, log_mlflow: bool = True,
                     run_name: str | None = None) -> TrainResult:
    """`lorafleet train` for task `rerank`: dataset, baselines, training, test, metrics.json + report.md, MLflow."""
    return run_kind(RerankRun(cfg), out_dir, log_mlflow=log_mlflow, run_name=run_name)


def _write_report(path: Path, cfg: RerankConfig, result: TrainResult) -> Path:
    m, s = result.metrics, cfg.first_stage
    lines = ["# Reranker training report", "",
             f"- cross-encoder base `{cfg.base_model}`, pairs of up to {cfg.max_pair_length} tokens; first stage "
             f"{s.kind} (top {s.depth} reranked); loss {cfg.loss}; LoRA r={cfg.lora.r} alpha={cfg.lora.alpha}",
             f"- dataset digest `{result.dataset_digest}`", ""]
    for split in ("dev", "test"):
        lines += [f"## {split}", "", "| metric | first stage alone | base reranker | LoRA reranker |",
                  "|---|---|---|---|"]
        for name in RerankKind.metrics.report:
            key = f"{split}_{name}"
            lines.append(f"| {name} | {m.get(f'{FIRST}_{key}', float('nan')):.4f} | "
                         f"{m.get(f'base_{key}', float('nan')):.4f} | {m.get(key, float('nan')):.4f} |")
        lines.append("")
    return save_report(path, lines, result.cost, cfg.price_per_hour_usd)
