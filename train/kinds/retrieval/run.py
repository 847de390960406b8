"""The retrieval kind's standalone run: its baselines (the base model and BM25), report.md and metrics.json extras."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, ClassVar

from lorafleet.core.metrics import prefixed
from lorafleet.core.tasks import EpochCallback, TrainResult
from lorafleet.models.device import resolve_device
from lorafleet.train.kinds.retrieval.config import DataConfig, TrainConfig
from lorafleet.train.kinds.retrieval.dataset import RetrievalDataset, build_dataset
from lorafleet.train.kinds.retrieval.evaluate import METRICS, BM25Evaluator, DenseEvaluator
from lorafleet.train.kinds.retrieval.trainer import load_base_model, train_adapter
from lorafleet.train.run import KindRun, run_kind, save_report

log = logging.getLogger("lorafleet.train")

HEADLINE = "test_ndcg@10"
TASK = "retrieval"  # the task kind whose headline metrics and view a run gets in MLflow


def baselines(cfg: TrainConfig, dataset: RetrievalDataset) -> dict[str, float]:
    """Base model and BM25 on dev and test, prefixed `base_` and `bm25_`."""
    t0 = time.perf_counter()
    bm25 = BM25Evaluator(dataset).evaluate(["dev", "test"])
    log.info("bm25: dev_ndcg@10 %.4f  test_ndcg@10 %.4f  (%.0f s)", bm25["dev_ndcg@10"], bm25["test_ndcg@10"],
             time.perf_counter() - t0)
    t0 = time.perf_counter()
    model = load_base_model(cfg.base_model, resolve_device(cfg.device), cfg.max_seq_length)
    base = DenseEvaluator(dataset, cfg.eval_batch_size).evaluate(model, ["dev", "test"])
    log.info("base: dev_ndcg@10 %.4f  test_ndcg@10 %.4f  (%.0f s)", base["dev_ndcg@10"], base["test_ndcg@10"],
             time.perf_counter() - t0)
    return {**prefixed(base, "base"), **prefixed(bm25, "bm25")}


def relative_lift(metrics: dict[str, float], split: str = "test", metric: str = "ndcg@10") -> float:
    base = metrics.get(f"base_{split}_{metric}", 0.0)
    return (metrics[f"{split}_{metric}"] - base) / base if base > 0 else float("nan")


def _data_line(cfg: TrainConfig) -> str:
    d = cfg.data
    if isinstance(d, DataConfig):
        return f"- laws: {', '.join(d.laws)}; query kinds: {', '.join(d.query_kinds)}"
    tables = [f"{t} `{ref.label()}`" for t in ("corpus", "queries", "qrels", "pairs")
              if (ref := getattr(d, t)) is not None]
    return f"- your data, layout `{d.layout}`: " + ", ".join(tables)


def write_report(path: Path, cfg: TrainConfig, dataset: RetrievalDataset, result: TrainResult) -> Path:
    m = result.metrics
    lines = [
        "# LoRA training report",
        "",
        f"- base model: `{cfg.base_model}`, max_seq_length {cfg.max_seq_length}, device {result.extras.get('device')}, "
        f"training precision {result.extras.get('training_precision', 'fp32')}",
        _data_line(cfg),
        f"- dataset digest: `{dataset.digest}`",
        "- dataset: " + ", ".join(f"{k} {v}" for k, v in dataset.summary().items()),
        f"- LoRA r={cfg.lora.r} alpha={cfg.lora.alpha} dropout={cfg.lora.dropout} targets={cfg.lora.target_modules}; "
        f"loss {cfg.loss}, lr {cfg.learning_rate}, epochs {cfg.epochs}, batch {cfg.batch_size}, "
        f"hard negatives {cfg.data.hard_negatives} ({int(m.get('train_pairs', 0))} training pairs, "
        f"{int(m.get('train_random_negative_queries', 0))} with random instead of mined negatives)",
        "",
        "Relevance is at section level; a section scores the best of its chunks (MaxP).",
        "",
    ]
    for split in ("dev", "test"):
        lines += [f"## {split}", "", "| metric | BM25 | base | LoRA | LoRA vs base |", "|---|---|---|---|---|"]
        for name in METRICS:
            key = f"{split}_{name}"
            base = m.get(f"base_{key}", float("nan"))
            lift = (m[key] - base) / base * 100 if base else float("nan")
            lines.append(f"| {name} | {m.get(f'bm25_{key}', float('nan')):.4f} | {base:.4f} | {m[key]:.4f} | "
                         f"{lift:+.1f} % |")
        for kind in sorted({q.kind for q in dataset.query_info.values()}):
            key = f"{split}_{kind}_ndcg@10"
            if key in m:
                lines.append(f"| ndcg@10, {kind} queries only | {m.get('bm25_' + key, float('nan')):.4f} | "
                             f"{m.get('base_' + key, float('nan')):.4f} | {m[key]:.4f} | "
                             f"{relative_lift(m, split, f'{kind}_ndcg@10') * 100:+.1f} % |")
        lines.append("")
    lines += ["## Epochs", "", "| epoch | train loss | dev nDCG@10 | dev MRR@10 |", "|---|---|---|---|"]
    lines += [f"| {int(e['epoch'])} | {e['train_loss']:.4f} | {e['dev_ndcg@10']:.4f} | {e['dev_mrr@10']:.4f} |"
              for e in result.epochs]
    lines.append("")
    return save_report(path, lines, result.cost, cfg.price_per_hour_usd)


class RetrievalRun(KindRun):
    task: ClassVar[str] = TASK

    def build_dataset(self) -> RetrievalDataset:
        return build_dataset(self.cfg)

    def baselines(self, dataset: RetrievalDataset) -> dict[str, float]:
        return baselines(self.cfg, dataset)

    def train(self, dataset: RetrievalDataset, out: Path, on_epoch: EpochCallback | None, *,
              evaluate_test: bool) -> TrainResult:
        return train_adapter(self.cfg, dataset, out, on_epoch=on_epoch, evaluate_test=evaluate_test)

    def finish(self, result: TrainResult, dataset: RetrievalDataset, out: Path) -> None:
        result.metrics["test_ndcg@10_lift"] = relative_lift(result.metrics, "test")
        result.metrics["dev_ndcg@10_lift"] = relative_lift(result.metrics, "dev")

    def report(self, path: Path, dataset: RetrievalDataset, result: TrainResult) -> Path:
        return write_report(path, self.cfg, dataset, result)

    def details(self, result: TrainResult, dataset: RetrievalDataset) -> dict[str, Any]:
        return {"base_model": self.cfg.base_model, "max_seq_length": self.cfg.max_seq_length}

    def done(self, result: TrainResult, out: Path) -> None:
        m = result.metrics
        log.info("done: test_ndcg@10 %.4f (base %.4f, bm25 %.4f, lift %+.1f %%) in %.0f s → %s", m["test_ndcg@10"],
                 m["base_test_ndcg@10"], m["bm25_test_ndcg@10"], 100 * m["test_ndcg@10_lift"],
                 result.cost["wall_s"], out)


def run_train(cfg: TrainConfig, out_dir: Path | None = None, *, log_mlflow: bool = True,
              mlflow_run_name: str | None = None) -> TrainResult:
    """Build the dataset, score the baselines, train, evaluate, write `metrics.json` + `report.md`, log to MLflow."""
    return run_kind(RetrievalRun(cfg), out_dir, log_mlflow=log_mlflow, run_name=mlflow_run_name)
