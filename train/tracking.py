"""MLflow for a standalone training run (`lorafleet train`), shared by every task kind.

A run goes to the experiment `lorafleet-train` (or becomes a child of the active run, inside a
research study). Names follow lorafleet.core.metrics: flat `{split}_{metric}`, '@' spelled `_at_`.

What the MLflow UI shows first is decided here, from the kind's `MetricSpec`: a run logs only the
kind's headline metrics (`headline_set`: test and dev of the adapter, the base model and the
baseline, cost; the objective and the training loss per epoch), so they lead the runs table and
the chart view; every other number (per query kind, recall@k, MAP, dataset sizes, …) goes to the
run's table artifact `metrics_table.json` and its report. The experiment is marked as model
training, carries a description and one saved runs view per task kind (`lorafleet-<kind>`).

A task kind's `run` uses, in this order: `train_run` → `log_config` → `log_dataset` → `log_headline`
(baselines) → `log_epoch` (per epoch) → `log_result` (end: headline, table, artifacts).
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from lorafleet.core import settings
from lorafleet.core.metrics import flatten_params, mlflow_key, mlflow_metrics, prefixed
from lorafleet.core.tasks import MetricSpec, TrainResult, get_task_kind

EXPERIMENT = "lorafleet-train"
TAG_TASK = "lorafleet.task"
TABLE_FILE = "metrics_table.json"
# MLflow's own experiment tags (mlflow/server/js): experiment kind, description, saved runs views.
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
KIND_MODEL_TRAINING = "custom_model_development"
TAG_DESCRIPTION = "mlflow.note.content"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
DESCRIPTION = ("Standalone LoRA trainings (`lorafleet train CONFIG`), one run each. Every run leads with its "
               "task kind's headline metrics: test of the adapter, the base model and the baseline side by side, "
               "dev, cost; every other number is in the run's `metrics_table.json` and `report.md`. Views → "
               "`lorafleet-<kind>` shows one kind's runs with those columns.")


@contextlib.contextmanager
def train_run(run_name: str | None, enabled: bool = True) -> Iterator[Any]:
    """An active MLflow run for the block (None when `enabled` is False); FAILED if the block raises."""
    if not enabled:
        yield None
        return
    import mlflow

    if mlflow.active_run() is not None:
        run = mlflow.start_run(run_name=run_name, nested=True)  # inside a research study: a child run
    else:
        mlflow.set_tracking_uri(settings.mlflow_tracking_uri())
        if mlflow.get_experiment_by_name(EXPERIMENT) is None:
            with contextlib.suppress(Exception):  # created concurrently by another run
                mlflow.create_experiment(EXPERIMENT, artifact_location=settings.mlflow_artifact_root(),
                                         tags={TAG_EXPERIMENT_KIND: KIND_MODEL_TRAINING, TAG_DESCRIPTION: DESCRIPTION})
        mlflow.set_experiment(EXPERIMENT)
        run = mlflow.start_run(run_name=run_name)
    status = "FAILED"
    try:
        yield run
        status = "FINISHED"
    finally:
        mlflow.end_run(status=status)


def log_config(cfg: Any, task: str) -> None:
    """The config as params, the kind as tag; in `lorafleet-train`, the experiment's tags and the kind's view."""
    import mlflow

    mlflow.log_params(flatten_params(cfg.model_dump(mode="json")))
    mlflow.set_tag(TAG_TASK, task)
    run = mlflow.active_run()
    experiment = mlflow.get_experiment(run.info.experiment_id) if run is not None else None
    if experiment is not None and experiment.name == EXPERIMENT:
        describe_experiment(experiment.experiment_id, task)


def describe_experiment(experiment_id: str, task: str) -> None:
    """Model-training kind, description, and the saved view `lorafleet-<task>` (written again each run)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri())
    spec = get_task_kind(task).metrics
    view = _view_tag(f"lorafleet: {task} ({spec.label or spec.headline})", _runs_view(spec, task))
    for key, value in ((TAG_EXPERIMENT_KIND, KIND_MODEL_TRAINING), (TAG_DESCRIPTION, DESCRIPTION),
                       (f"{VIEW_TAG_PREFIX}lorafleet-{task}", view)):
        client.set_experiment_tag(experiment_id, key, value)


def dataset_name(task: str, dataset: Any) -> str:
    """How the runs table names a dataset: the task kind and the laws it is built from (`retrieval/agg+kschg`).

    The same rule as lorafleet.research.tracking.dataset_name (research trials on the same data show the
    same name and digest)."""
    laws = (getattr(dataset, "settings", None) or {}).get("laws") or []
    return f"{task}/{'+'.join(laws)}" if laws else task


def log_dataset(frame: Any, name: str, digest: str, summary: dict[str, int]) -> None:
    """The dataset as an MLflow input (the runs table's Dataset column: name and digest; its sizes in the
    dataset's profile and the run's table), its full digest as a tag."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.entities import Dataset, DatasetInput, InputTag

    entity = mlflow.data.from_pandas(frame, name=name, digest=digest[:36])._to_mlflow_entity()
    profile = {**json.loads(entity.profile or "{}"), **summary}
    entity = Dataset(entity.name, entity.digest, entity.source_type, entity.source, entity.schema,
                     json.dumps(profile))
    run = mlflow.active_run()
    MlflowClient().log_inputs(run.info.run_id, [DatasetInput(entity, [InputTag("mlflow.data.context", "training")])])
    mlflow.set_tag("dataset_digest", digest)
    mlflow.log_table(_frame([{"name": f"dataset_{k}", "model": "dataset", "split": "", "metric": k, "step": None,
                              "value": float(v)} for k, v in summary.items()]), TABLE_FILE)


def log_metrics(metrics: dict[str, Any], step: int | None = None, prefix: str = "") -> None:
    """Every given metric, as is (prefer `log_headline`: runs log their kind's headline set only)."""
    import mlflow

    mlflow.log_metrics(mlflow_metrics(metrics, prefix), step=step)


def log_headline(metrics: Mapping[str, Any], task: str | None = None, step: int | None = None) -> None:
    """Only the kind's headline metrics of `metrics` (e.g. the baselines' `base_test_ndcg@10`, …); the rest
    reaches the run's table through `result.metrics` in `log_result`, or `log_tail_table`."""
    import mlflow

    spec = _spec(task)
    mlflow.log_metrics(mlflow_metrics({k: metrics[k] for k in spec.headline_set if k in metrics}), step=step)


def log_epoch(epoch: int, dev: Mapping[str, Any], task: str | None = None) -> None:
    """After an epoch: the objective with the epoch as step (the live curve); the rest reaches the table
    through `TrainResult.epochs` in `log_result`."""
    import mlflow

    objective = _spec(task).objective
    if objective in dev:
        mlflow.log_metrics(mlflow_metrics({objective: dev[objective]}), step=epoch)


def log_tail_table(metrics: Mapping[str, Any], task: str | None = None, *, model: str = "adapter",
                   step: int | None = None) -> None:
    """`metrics` as rows of the run's table artifact (`metrics_table.json`; rows are appended)."""
    import mlflow

    rows = _spec(task).rows(metrics, model=model, step=step)
    if rows:
        mlflow.log_table(_frame(rows), TABLE_FILE)


def log_result(run: Any, result: TrainResult, out_dir: Path, *, live_epochs: bool = False,
               task: str | None = None) -> None:
    """The end of a run: headline metrics, the table of everything, the adapter, report, metrics.json.

    Per epoch (step = epoch) the training loss and the objective (unless `live_epochs`: `log_epoch` sent the
    objective already); at the end the kind's headline set of `result.metrics` and cost (`cost_wall_s`,
    `cost_usd`, …); every metric, every epoch's metrics and the cost go to `metrics_table.json`.
    """
    import mlflow

    spec = _spec(task)
    for e in result.epochs:
        row = {k: e[k] for k in ("train_loss", *(() if live_epochs else (spec.objective,))) if k in e}
        mlflow.log_metrics(mlflow_metrics(row), step=int(e["epoch"]))
    per_epoch = {spec.objective} if result.epochs else set()  # already logged with step=epoch
    cost = prefixed(result.cost, "cost")
    log_headline({k: v for k, v in {**result.metrics, **cost}.items() if k not in per_epoch}, task)
    rows = spec.rows({**result.metrics, **cost})
    for e in result.epochs:
        rows += spec.rows({k: v for k, v in e.items() if k != "epoch"}, step=int(e["epoch"]))
    mlflow.log_table(_frame(rows), TABLE_FILE)
    if result.extras.get("training_precision"):  # what `precision` resolved to on this machine (fp32 or bf16)
        mlflow.log_param("training_precision", result.extras["training_precision"])
    mlflow.log_artifacts(str(result.adapter_dir), "adapter")
    for path in (result.report_path, out_dir / "metrics.json", out_dir / "predictions.jsonl"):
        if path is not None and Path(path).is_file():
            mlflow.log_artifact(str(path))
    result.extras["mlflow_run_id"] = run.info.run_id


def _spec(task: str | None) -> MetricSpec:
    """The kind's metrics; without `task`, the kind `log_config` tagged the active run with."""
    if task is None:
        import mlflow

        run = mlflow.active_run()
        task = mlflow.get_run(run.info.run_id).data.tags.get(TAG_TASK) if run is not None else None
    return get_task_kind(task or "retrieval").metrics


def _frame(rows: list[dict[str, Any]]) -> Any:
    import pandas as pd

    return pd.DataFrame(rows)


def _runs_view(spec: MetricSpec, task: str) -> dict[str, Any]:
    """The saved runs view of one kind in `lorafleet-train`: its runs, the dataset and its headline columns
    (the same page state as lorafleet.research.tracking.runs_view writes, without grouping)."""
    # The adapter, the base model and the baseline on test side by side, dev, cost (Duration shows time).
    metrics = [m for m in spec.headline_set if m.endswith(spec.headline) or m in (spec.objective, "cost_usd")]
    columns = ["attributes.`Dataset`", *(f"metrics.`{mlflow_key(m)}`" for m in metrics)]
    widths = {c: 200 if c.startswith("attributes") else 90 if "cost_" in c else 140 for c in columns}
    section = "lorafleet-headline"
    return {
        "searchFilter": f"tags.`{TAG_TASK}` = '{task}'", "orderByKey": "attributes.start_time", "orderByAsc": False,
        "startTime": "ALL", "lifecycleFilter": "Active", "datasetsFilter": [], "modelVersionFilter": "All Runs",
        "selectedColumns": columns, "columnOrder": columns, "columnWidths": widths, "runsHiddenMode": "FIRST_20_RUNS",
        "compareRunCharts": [{"uuid": f"lorafleet-{i}", "type": "BAR", "runsCountToCompare": 20,
                              "metricSectionId": section, "deleted": False, "isGenerated": True,
                              "displayName": mlflow_key(m), "metricKey": mlflow_key(m)}
                             for i, m in enumerate(spec.headline_set)],
        "compareRunSections": [{"uuid": section, "name": f"Headline: {spec.label or spec.headline}", "display": True,
                                "isReordered": True, "deleted": False, "isGenerated": True}],
        "viewMaximized": False, "runListHidden": False, "isAccordionReordered": False,
        "useGroupedValuesInCharts": False, "hideEmptyCharts": True, "groupBy": None, "groupsExpanded": {},
        "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
    }


def _view_tag(name: str, state: Mapping[str, Any]) -> str:
    """A saved runs view as the MLflow UI stores it: an envelope around the deflated JSON of the page state."""
    packed = "deflate;" + base64.b64encode(zlib.compress(json.dumps(state, separators=(",", ":")).encode())).decode()
    now = int(time.time() * 1000)
    return json.dumps({"name": name, "createdAt": now, "updatedAt": now, "state": packed}, separators=(",", ":"))
