"""One full training run, as `lorafleet train` does it: dataset, baselines, LoRA, evaluation, report, MLflow."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import yaml

from lorafleet import settings
from lorafleet.device import resolve_device
from lorafleet.metrics import prefixed
from lorafleet.tasks import TrainResult
from lorafleet.train import tracking
from lorafleet.train.config import DataConfig, TrainConfig
from lorafleet.train.dataset import RetrievalDataset, build_dataset
from lorafleet.train.evaluate import METRICS, BM25Evaluator, DenseEvaluator
from lorafleet.train.trainer import CostMeter, load_base_model, train_adapter

log = logging.getLogger("lorafleet.train")

HEADLINE = "test_ndcg@10"
TASK = "retrieval"  # the task kind whose headline metrics and view a run gets in MLflow


def default_out_dir() -> Path:
    return settings.home() / "runs" / time.strftime("train-%Y%m%d-%H%M%S")


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
    c = result.cost
    lines += ["", "## Cost", "",
              f"wall {c['wall_s']:.0f} s, CPU {c['cpu_s']:.0f} s, peak RSS {c['peak_rss_mb']:.0f} MB, "
              f"≈ ${c['usd']:.4f} at ${cfg.price_per_hour_usd}/h", ""]
    path.write_text("\n".join(lines))
    return path


def run_train(
    cfg: TrainConfig,
    out_dir: Path | None = None,
    *,
    log_mlflow: bool = True,
    mlflow_run_name: str | None = None,
) -> TrainResult:
    """Build the dataset, score the baselines, train, evaluate, write `metrics.json` + `report.md`, log to MLflow."""
    meter = CostMeter(cfg.price_per_hour_usd)
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dataset = build_dataset(cfg)
    log.info("dataset %s: %s (%.0f s)", dataset.digest[:12], dataset.summary(), time.perf_counter() - t0)
    (out / "train_config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False, allow_unicode=True))

    with tracking.train_run(mlflow_run_name, enabled=log_mlflow) as run:
        if run is not None:
            tracking.log_config(cfg, TASK)
            tracking.log_dataset(dataset.to_frame(), tracking.dataset_name(TASK, dataset), dataset.digest,
                                 dataset.summary())
        base = baselines(cfg, dataset)
        if run is not None:
            tracking.log_headline(base, TASK)  # all of them reach the run's table with the result

        def on_epoch(epoch: int, dev: dict[str, float]) -> None:
            if run is not None:
                tracking.log_epoch(epoch, dev, TASK)

        # A standalone run is a single model, so it reports test; research trials never do (winner only).
        result = train_adapter(cfg, dataset, out, on_epoch=on_epoch, evaluate_test=True)
        result.metrics.update(base)
        result.metrics["test_ndcg@10_lift"] = relative_lift(result.metrics, "test")
        result.metrics["dev_ndcg@10_lift"] = relative_lift(result.metrics, "dev")
        result.extras["train_cost"] = result.cost
        result.cost = meter.read()
        result.report_path = write_report(out / "report.md", cfg, dataset, result)
        (out / "metrics.json").write_text(json.dumps({
            "metrics": result.metrics, "epochs": result.epochs, "cost": result.cost,
            "train_cost": result.extras["train_cost"], "dataset_digest": dataset.digest,
            "dataset": dataset.summary(), "base_model": cfg.base_model, "max_seq_length": cfg.max_seq_length,
        }, indent=2, sort_keys=True))
        if run is not None:
            tracking.log_result(run, result, out, live_epochs=True, task=TASK)
        log.info("done: test_ndcg@10 %.4f (base %.4f, bm25 %.4f, lift %+.1f %%) in %.0f s → %s",
                 result.metrics["test_ndcg@10"], result.metrics["base_test_ndcg@10"],
                 result.metrics["bm25_test_ndcg@10"], 100 * result.metrics["test_ndcg@10_lift"],
                 result.cost["wall_s"], out)
        return result
