"""One standalone training run (`lorafleet train`), the same for every kind: dataset, baselines, training with the
one look at test, metrics.json and report.md, and the MLflow run. A kind supplies its parts as a `KindRun`."""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import yaml

from lorafleet.core import settings
from lorafleet.core.tasks import EpochCallback, TaskKind, TrainResult
from lorafleet.train import tracking
from lorafleet.train.loop import CostMeter

log = logging.getLogger("lorafleet.train")


def default_out_dir(prefix: str = "train") -> Path:
    return settings.home() / "runs" / time.strftime(f"{prefix}-%Y%m%d-%H%M%S")


def save_report(path: Path, lines: list[str], cost: dict[str, float], price_per_hour_usd: float,
                note: str = "") -> Path:
    """`lines` and the run's cost section (with `note` after it, e.g. training throughput) as `path`."""
    lines = [*lines, "## Cost", "",
             f"wall {cost['wall_s']:.0f} s, CPU {cost['cpu_s']:.0f} s, peak RSS {cost['peak_rss_mb']:.0f} MB, "
             f"≈ ${cost['usd']:.4f} at ${price_per_hour_usd}/h{note}", ""]
    path.write_text("\n".join(lines))
    return path


class KindRun(ABC):
    """One kind's parts of a standalone run; `run_kind` drives them and owns the rest (folders, MLflow, cost).

    Call order, in the caller's thread: `build_dataset()` → `baselines(dataset)` (flat `base_*`/`<baseline>_*`
    metrics, merged into the result) → `train(dataset, out, on_epoch, evaluate_test=True)` (the kind's training
    with test scored once; `on_epoch` logs each epoch's dev metrics to MLflow) → `finish(result, dataset, out)`
    (optional: further metrics, extra files) → `report(path, dataset, result)` → `details(result, dataset)`
    (optional: what metrics.json records beside the metrics) → `done(result, out)` (optional: the last log line).
    `task` names the kind in MLflow; `out_prefix` starts the default output folder's name.
    """

    task: ClassVar[str]
    out_prefix: ClassVar[str] = "train"

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    @abstractmethod
    def build_dataset(self) -> Any: ...

    @abstractmethod
    def baselines(self, dataset: Any) -> dict[str, float]: ...

    @abstractmethod
    def train(self, dataset: Any, out: Path, on_epoch: EpochCallback | None, *, evaluate_test: bool) -> TrainResult:
        ...

    @abstractmethod
    def report(self, path: Path, dataset: Any, result: TrainResult) -> Path: ...

    def finish(self, result: TrainResult, dataset: Any, out: Path) -> None:
        return None

    def details(self, result: TrainResult, dataset: Any) -> dict[str, Any]:
        return {}

    def done(self, result: TrainResult, out: Path) -> None:
        return None


def run_kind(kind: KindRun, out_dir: Path | None = None, *, log_mlflow: bool = True,
             run_name: str | None = None) -> TrainResult:
    """Build the dataset, score the baselines, train (test once), write `train_config.yaml`, `metrics.json` and
    `report.md` into `out_dir`, and (with `log_mlflow`) track it all as one MLflow run."""
    cfg = kind.cfg
    meter = CostMeter(cfg.price_per_hour_usd)
    out = Path(out_dir) if out_dir is not None else default_out_dir(kind.out_prefix)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False,
                                                          allow_unicode=True))
    t0 = time.perf_counter()
    dataset = kind.build_dataset()
    log.info("dataset %s: %s (%.0f s)", dataset.digest[:12], dataset.summary(), time.perf_counter() - t0)
    stages: dict[str, float] = {"dataset_s": round(time.perf_counter() - t0, 2)}
    with tracking.train_run(run_name, enabled=log_mlflow) as run:
        if run is not None:
            tracking.log_config(cfg, kind.task)
            tracking.log_dataset(dataset.to_frame(), tracking.dataset_name(kind.task, dataset), dataset.digest,
                                 dataset.summary())
        t0 = time.perf_counter()
        base = kind.baselines(dataset)
        stages["baselines_s"] = round(time.perf_counter() - t0, 2)
        if run is not None:
            tracking.log_headline(base, kind.task)  # all of them reach the run's table with the result

        def on_epoch(epoch: int, dev: dict[str, float]) -> None:
            if run is not None:
                tracking.log_epoch(epoch, dev, kind.task)

        # A standalone run is a single model, so it reports test; research trials never do (winner only).
        result = kind.train(dataset, out, on_epoch, evaluate_test=True)
        stages["train_and_eval_s"] = result.cost["wall_s"]
        result.metrics.update(base)
        result.extras.update(train_cost=result.cost, stages=stages)
        kind.finish(result, dataset, out)
        result.cost = meter.read()
        result.report_path = kind.report(out / "report.md", dataset, result)
        (out / "metrics.json").write_text(json.dumps({
            "metrics": result.metrics, "epochs": result.epochs, "cost": result.cost,
            "train_cost": result.extras["train_cost"], "dataset_digest": dataset.digest, "dataset": dataset.summary(),
            **kind.details(result, dataset)}, indent=2, sort_keys=True))
        if run is not None:
            tracking.log_result(run, result, out, live_epochs=True, task=kind.task)
    kind.done(result, out)
    return result


class LoopKind(TaskKind):
    """A task kind whose dataset, baselines, training and standalone run are those of its `KindRun`: a kind built
    on lorafleet.train implements `kind_run(cfg)` (import the run's module inside it: loading a kind stays cheap)
    and `evaluate`, and sets the TaskKind class attributes; research's `train` scores dev only."""

    @abstractmethod
    def kind_run(self, cfg: Any) -> KindRun: ...

    def build_dataset(self, cfg: Any) -> Any:
        return self.kind_run(cfg).build_dataset()

    def baselines(self, cfg: Any, dataset: Any) -> dict[str, float]:
        return self.kind_run(cfg).baselines(dataset)

    def train(self, cfg: Any, dataset: Any, out_dir: Path, *, on_epoch: EpochCallback | None = None) -> TrainResult:
        return self.kind_run(cfg).train(dataset, Path(out_dir), on_epoch, evaluate_test=False)

    def run(self, cfg: Any, out_dir: Path | None = None, *, log_mlflow: bool = True,
            run_name: str | None = None) -> TrainResult:
        return run_kind(self.kind_run(cfg), out_dir, log_mlflow=log_mlflow, run_name=run_name)
