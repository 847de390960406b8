"""MLflow side of a research run: one parent run per study, one nested run per Optuna trial.

Nested runs are found again by tags (study + trial number), never by order, so a resumed or a
second process never logs a trial twice. Metric names keep train's names with '@' spelled
'_at_' (MLflow does not accept '@'), e.g. `dev_ndcg_at_10`; they are the same in every trial so
the compare view lines trials up.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lorafleet import settings

TAG_STUDY = "lorafleet.study"
TAG_ROLE = "lorafleet.role"
TAG_TRIAL = "lorafleet.trial_number"
TAG_STATE = "lorafleet.trial_state"
TAG_REASON = "lorafleet.reason"
TAG_RETRY_OF = "lorafleet.retry_of"
PARENT_TAG = "mlflow.parentRunId"

STATE_TO_STATUS = {"complete": "FINISHED", "pruned": "FINISHED", "failed": "FAILED"}


def metric_key(name: str) -> str:
    return name.replace("@", "_at_")


def experiment_name(study: str) -> str:
    return f"lorafleet-research/{study}"


class Tracker:
    """Thin, process-safe wrapper over MlflowClient for one study."""

    def __init__(self, study: str, tracking_uri: str | None = None) -> None:
        from mlflow import MlflowClient

        self.study = study
        self.tracking_uri = tracking_uri or settings.mlflow_tracking_uri()
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.experiment_id = self._experiment()

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
                return self.client.create_experiment(name, artifact_location=location)
            except MlflowException:
                time.sleep(0.5)  # another process created it in between; read it back
        raise RuntimeError(f"could not create or read MLflow experiment {name}")

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

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        for k, v in tags.items():
            self.client.set_tag(run_id, k, str(v))

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def terminate(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)
