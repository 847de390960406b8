"""MLflow side of a research run: one parent run per study, one nested run per Optuna trial.

Nested runs are found again by tags (study + trial number), never by order, so a resumed or a
second process never logs a trial twice. Metric names follow lorafleet.core.metrics (`mlflow_key`
spells '@' as `_at_`, e.g. `dev_ndcg_at_10`) and are the same in every trial, so the compare view
lines trials up.

What a user sees first in the MLflow UI is set here: the experiment is marked as model training
(`mlflow.experimentKind`), carries a description, and holds a saved runs view named `lorafleet`
(headline columns, the dataset, trial state, sorted by the objective, every run shown). Runs log
only their kind's headline metrics (`MetricSpec.headline_set`, the objective per epoch); every
other number goes to the run's table artifact `metrics_table.json` (`log_table`) and the report.
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lorafleet.core import settings
from lorafleet.core.metrics import mlflow_key
from lorafleet.core.tasks import MetricSpec

TAG_STUDY = "lorafleet.study"
TAG_ROLE = "lorafleet.role"
TAG_TRIAL = "lorafleet.trial_number"
TAG_STATE = "lorafleet.trial_state"
TAG_REASON = "lorafleet.reason"
TAG_RETRY_OF = "lorafleet.retry_of"
PARENT_TAG = "mlflow.parentRunId"

# MLflow's own experiment tags (mlflow/server/js: experiment kind, description, saved views).
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
KIND_MODEL_TRAINING = "custom_model_development"
TAG_DESCRIPTION = "mlflow.note.content"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
VIEW_KEY = "lorafleet"  # the runs view lorafleet keeps; `?viewStateShareKey=lorafleet` opens it
TABLE_FILE = "metrics_table.json"
ADAPTER_ARTIFACT = "adapter"  # a completed trial's adapter in its run (what the summary takes the winner from)

STATE_TO_STATUS = {"complete": "FINISHED", "pruned": "FINISHED", "failed": "FAILED"}


def metric_key(name: str) -> str:
    return mlflow_key(name)


def experiment_name(study: str) -> str:
    return f"lorafleet-research/{study}"


def headline(metrics: Mapping[str, Any], spec: MetricSpec) -> dict[str, Any]:
    """The part of `metrics` that a run logs as MLflow metrics: the kind's headline set."""
    return {k: metrics[k] for k in spec.headline_set if k in metrics}


def column(kind: str, name: str) -> str:
    """A runs-table column key as the MLflow UI writes it: ``metrics.`test_ndcg_at_10` ``."""
    return f"{kind}.`{mlflow_key(name) if kind == 'metrics' else name}`"


def view_tag(name: str, state: Mapping[str, Any]) -> str:
    """A saved runs view as the MLflow UI stores it in an experiment tag (an envelope around the
    deflated JSON of the page state: search facets plus table and chart settings)."""
    packed = "deflate;" + base64.b64encode(zlib.compress(json.dumps(state, separators=(",", ":")).encode())).decode()
    now = int(time.time() * 1000)
    return json.dumps({"name": name, "createdAt": now, "updatedAt": now, "state": packed}, separators=(",", ":"))


def runs_view(spec: MetricSpec, *, tag_columns: Sequence[str] = (), param_columns: Sequence[str] = (),
              group_by_tag: str | None = None, search_filter: str = "", order_by: str | None = None
              ) -> dict[str, Any]:
    """The page state of lorafleet's runs view: the dataset, the kind's headline metrics side by side,
    then the given tags and params as columns, sorted by the objective, optionally grouped by a tag (which
    shows nested runs flat, so no run hides behind a collapsed parent). The charts show the headline set
    in the same order, the headline first."""
    # The table: the adapter, the base model and the baseline on test side by side, the objective, cost (the
    # Duration column shows time; base and baseline on dev are in the charts and the parent's table).
    metrics = [m for m in spec.headline_set if m.endswith(spec.headline) or m in (spec.objective, "cost_usd")]
    columns = [column("attributes", "Dataset"), *(column("metrics", m) for m in metrics),
               *(column("tags", t) for t in tag_columns), *(column("params", p) for p in param_columns)]
    widths = {c: 200 if c.startswith("attributes") else 90 if "cost_" in c else 140 if c.startswith("metrics")
              else 110 for c in columns}  # pixels: at 1600 wide, all headline columns and the state fit
    section = "lorafleet-headline"
    charts = [{"uuid": f"lorafleet-{i}", "type": "BAR", "runsCountToCompare": 20, "metricSectionId": section,
               "deleted": False, "isGenerated": True, "displayName": mlflow_key(m), "metricKey": mlflow_key(m)}
              for i, m in enumerate(spec.headline_set)]
    return {
        "searchFilter": search_filter,
        "orderByKey": column("metrics", order_by or spec.objective),
        "orderByAsc": spec.direction == "minimize",
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "datasetsFilter": [],
        "modelVersionFilter": "All Runs",
        "selectedColumns": columns,
        "columnOrder": columns,
        "columnWidths": widths,
        "runsHiddenMode": "FIRST_20_RUNS",
        "compareRunCharts": charts,
        "compareRunSections": [{"uuid": section, "name": f"Headline: {spec.label or spec.headline}", "display": True,
                                "isReordered": True, "deleted": False, "isGenerated": True}],
        "viewMaximized": False,
        "runListHidden": False,
        "isAccordionReordered": False,
        "useGroupedValuesInCharts": False,
        "hideEmptyCharts": True,
        "groupBy": None if group_by_tag is None else {
            "aggregateFunction": "max" if spec.direction == "maximize" else "min",
            "groupByKeys": [{"mode": "tag", "groupByData": group_by_tag}]},
        "groupsExpanded": {},
        "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
    }


def dataset_name(task: str, dataset: Any) -> str:
    """How the runs table names a dataset: the task kind and the laws it is built from (`retrieval/agg+kschg`).

    The same rule as lorafleet.train.tracking.dataset_name, so research trials and `lorafleet train` runs on
    the same data show the same name (and digest)."""
    laws = (getattr(dataset, "settings", None) or {}).get("laws") or []
    return f"{task}/{'+'.join(laws)}" if laws else task


class Tracker:
    """Thin, process-safe wrapper over MlflowClient for one study."""

    def __init__(self, study: str, tracking_uri: str | None = None) -> None:
        from mlflow import MlflowClient

        self.study = study
        self.tracking_uri = tracking_uri or settings.mlflow_tracking_uri()
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.experiment_id = self._experiment()
        self._datasets: dict[str, Any] = {}

    def _experiment(self) -> str:
        from mlflow.exceptions import MlflowException

        name = experiment_name(self.study)
        for _ in range(5):
            exp = self.client.get_experiment_by_name(name)
            if exp is not None:
                if exp.lifecycle_stage == "deleted":
                    self.client.restore_experiment(exp.experiment_id)
                return exp.experiment_id
            try:
                location = None
                if self.tracking_uri.startswith("sqlite:"):
                    location = f"{settings.mlflow_artifact_root()}/research-{self.study}"
                return self.client.create_experiment(name, artifact_location=location,
                                                     tags={TAG_EXPERIMENT_KIND: KIND_MODEL_TRAINING})
            except MlflowException:
                time.sleep(0.5)  # another process created it in between; read it back
        raise RuntimeError(f"could not create or read MLflow experiment {name}")

    def describe(self, task: str, spec: MetricSpec, params: Sequence[str] = (), objective: str | None = None
                 ) -> None:
        """Mark the experiment as model training, describe it, and (re)write lorafleet's runs view.

        Done on every session start, so stores made by older versions get them too; `params` are the
        searched parameters, shown as columns; `objective` (default the kind's) sorts the runs."""
        label = spec.label or spec.headline
        baseline = (f", the base model's and the {spec.baseline_label} baseline's" if spec.baseline
                    else " and the base model's")
        text = (f"lorafleet research study **{self.study}** (task kind `{task}`). The parent run "
                f"`research-{self.study}` holds the winner's test {label}{baseline} side by side, the verdict "
                f"and `report.md`; each Optuna trial is a nested run (dev {label} per epoch, state, parameters); "
                "`trial-NNN-seedN` re-trains the winner with a second seed. Views → `lorafleet` shows these "
                f"columns; every other number is in each run's `{TABLE_FILE}`.")
        view = runs_view(spec, tag_columns=(TAG_STATE,), param_columns=params, group_by_tag=TAG_STUDY,
                         order_by=objective)
        for key, value in ((TAG_EXPERIMENT_KIND, KIND_MODEL_TRAINING), (TAG_DESCRIPTION, text),
                           (VIEW_TAG_PREFIX + VIEW_KEY, view_tag(f"lorafleet: {label}", view))):
            self.client.set_experiment_tag(self.experiment_id, key, value)

    # ---- parent run -------------------------------------------------------------------------
    def create_parent(self, storage: str, fingerprint: str) -> str:
        run = self.client.create_run(
            self.experiment_id, run_name=f"research-{self.study}",
            tags={TAG_STUDY: self.study, TAG_ROLE: "parent", "lorafleet.optuna_storage": storage,
                  "lorafleet.space_fingerprint": fingerprint},
        )
        return run.info.run_id

    def reopen(self, run_id: str) -> None:
        """Mark a parent (finished or killed earlier) as running again; its history is kept."""
        if self.client.get_run(run_id).info.status != "RUNNING":
            self.client.update_run(run_id, status="RUNNING")

    def parents(self) -> list[Any]:
        return self.client.search_runs([self.experiment_id], f"tags.`{TAG_ROLE}` = 'parent'")

    # ---- trial runs -------------------------------------------------------------------------
    def trial_runs(self, parent_id: str) -> dict[int, Any]:
        runs = self.client.search_runs(
            [self.experiment_id], f"tags.`{TAG_ROLE}` = 'trial' and tags.`{PARENT_TAG}` = '{parent_id}'",
            max_results=5000,
        )
        return {int(r.data.tags[TAG_TRIAL]): r for r in runs}

    def start_trial(self, parent_id: str, number: int, params: Mapping[str, Any], retry_of: int | None) -> str:
        existing = self.client.search_runs(
            [self.experiment_id],
            f"tags.`{TAG_ROLE}` = 'trial' and tags.`{PARENT_TAG}` = '{parent_id}' and tags.`{TAG_TRIAL}` = '{number}'",
        )
        if existing:  # a trial number is run once by Optuna; this only guards a crash between create and use
            return existing[0].info.run_id
        tags = {PARENT_TAG: parent_id, TAG_STUDY: self.study, TAG_ROLE: "trial", TAG_TRIAL: str(number),
                TAG_STATE: "running"}
        if retry_of is not None:
            tags[TAG_RETRY_OF] = str(retry_of)
        run = self.client.create_run(self.experiment_id, run_name=f"trial-{number:03d}", tags=tags)
        self.log_params(run.info.run_id, params)
        return run.info.run_id

    def create_child(self, parent_id: str, role: str, name: str, params: Mapping[str, Any]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=name,
                                     tags={PARENT_TAG: parent_id, TAG_STUDY: self.study, TAG_ROLE: role})
        self.log_params(run.info.run_id, params)
        return run.info.run_id

    def finish_trial(self, run_id: str, state: str, reason: str | None = None) -> None:
        self.client.set_tag(run_id, TAG_STATE, state)
        if reason:
            self.client.set_tag(run_id, TAG_REASON, reason[:4000])
        self.client.set_terminated(run_id, status=STATE_TO_STATUS[state])

    # ---- logging ----------------------------------------------------------------------------
    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        if params:
            self.client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int = 0, prefix: str = "") -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(metric_key(prefix + k), float(v), now, step) for k, v in metrics.items()
                 if isinstance(v, int | float) and not isinstance(v, bool)]
        if batch:
            self.client.log_batch(run_id, metrics=batch)

    def log_headline(self, run_id: str, metrics: Mapping[str, Any], spec: MetricSpec, step: int = 0) -> None:
        """Only the kind's headline metrics of `metrics`, as MLflow metrics."""
        self.log_metrics(run_id, headline(metrics, spec), step=step)

    def log_table(self, run_id: str, rows: Sequence[Mapping[str, Any]], artifact_file: str = TABLE_FILE) -> None:
        """Rows (e.g. `MetricSpec.rows`) as an MLflow table artifact; written again, it is replaced, not appended."""
        import pandas as pd

        if not rows:
            return
        frame = pd.DataFrame(list(rows))
        folder = str(Path(artifact_file).parent) if Path(artifact_file).parent != Path(".") else None
        if artifact_file not in {a.path for a in self.client.list_artifacts(run_id, folder)}:
            self.client.log_table(run_id, frame, artifact_file)
            return
        # MlflowClient.log_table appends to an existing table (a summary written again would double it);
        # write the same format (pandas "split" JSON) over it instead. The run already carries the table tag.
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / Path(artifact_file).name
            frame.to_json(path, orient="split", index=False, date_format="iso")
            self.client.log_artifact(run_id, str(path), folder)

    def log_dataset(self, run_id: str, dataset: Any, task: str) -> None:
        """The dataset as the run's input (the runs table's Dataset column: name and digest)."""
        from mlflow.entities import DatasetInput, InputTag

        digest = str(getattr(dataset, "digest", "") or "")
        if not digest:
            return
        if digest not in self._datasets:
            self._datasets[digest] = _dataset_entity(dataset, dataset_name(task, dataset), digest)
        self.client.log_inputs(run_id, [DatasetInput(self._datasets[digest],
                                                      [InputTag("mlflow.data.context", "training")])])

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        for k, v in tags.items():
            self.client.set_tag(run_id, k, str(v))

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_artifacts(self, run_id: str, folder: Path, artifact_path: str) -> None:
        self.client.log_artifacts(run_id, str(folder), artifact_path)

    def download_artifacts(self, run_id: str, artifact_path: str, dest: Path) -> Path:
        """`artifact_path` of the run into `dest` (replaced): the local folder, from any store the client reaches."""
        from mlflow.artifacts import download_artifacts

        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        return Path(download_artifacts(run_id=run_id, artifact_path=artifact_path, dst_path=str(dest),
                                       tracking_uri=self.tracking_uri))

    def terminate(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)


def _dataset_entity(dataset: Any, name: str, digest: str) -> Any:
    """An MLflow dataset entity: name, digest, and the kind's summary (sizes) as its profile; the schema too
    when the kind can show its data as a table (`to_frame()`), as lorafleet.train.tracking.log_dataset does."""
    from mlflow.entities import Dataset

    summary = dataset.summary() if callable(getattr(dataset, "summary", None)) else {}
    to_frame = getattr(dataset, "to_frame", None)
    if not callable(to_frame):
        return Dataset(name=name, digest=digest[:36], source_type="code", source=json.dumps({"tags": {}}),
                       profile=json.dumps(summary))
    import mlflow.data

    entity = mlflow.data.from_pandas(to_frame(), name=name, digest=digest[:36])._to_mlflow_entity()
    return Dataset(entity.name, entity.digest, entity.source_type, entity.source, entity.schema,
                   json.dumps({**json.loads(entity.profile or "{}"), **summary}))
