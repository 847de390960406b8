"""One process driving one research study: its stores, Optuna study, MLflow parent run, baseline and trials.

Several processes may drive one study (each has its own Session); state they share lives in the
Optuna storage (trials, the config snapshot, the parent run id, the baseline) and in MLflow.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from lorafleet.core import settings
from lorafleet.core.metrics import flatten_params
from lorafleet.core.tasks import TaskKind

from .config import LoadedConfig, config_point, space_fingerprint
from .objective import DatasetCache, TrialObjective
from .progress import Progress
from .study import (
    ATTR_BASELINE,
    ATTR_FINALIZE_CLAIM,
    ATTR_FINALIZED,
    ATTR_JUDGED,
    ATTR_PARENT_RUN,
    counted_trials,
    fail_stale,
    make_storage,
    open_study,
    recover_dead_local_trials,
    redact,
    retry_trial,
    storage_url,
    study_attr,
    worker_id,
)
from .tracking import Tracker

TERMINAL = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed"}


def snapshot(loaded: LoadedConfig) -> dict[str, Any]:
    """What a study stores of its config, so `resume NAME` needs no YAML."""
    return {"task": loaded.task, "train": loaded.train_raw, "research": loaded.research.model_dump(mode="json"),
            "source": loaded.source}


def flat_config(loaded: LoadedConfig) -> dict[str, Any]:
    """The study's config as MLflow params of its parent run (the search space as one JSON value)."""
    research = loaded.research.model_dump(mode="json")
    out: dict[str, Any] = {"task": loaded.task}
    out.update(flatten_params(loaded.train_raw, "train"))
    out.update(flatten_params({k: v for k, v in research.items() if k != "space"}, "research"))
    out["research.space"] = json.dumps(research["space"], sort_keys=True)
    return out


class Session:
    """One process driving one study: its stores, its study and MLflow parent run, its trials."""

    def __init__(self, loaded: LoadedConfig, kind: TaskKind, *, storage: str | None, resume: bool,
                 worker_only: bool, progress_live: bool | None) -> None:
        self.loaded, self.kind, self.cfg = loaded, kind, loaded.research
        self.name = self.cfg.study
        self.url = storage_url(storage)
        self.resume, self.worker_only, self.progress_live = resume, worker_only, progress_live
        with _local_init_lock():
            self.tracker = Tracker(self.name)
            self.storage = make_storage(self.url, self.cfg, on_stale=self._on_interrupted)
            self.study, self.created = open_study(self.name, self.storage, self.cfg, snapshot(loaded),
                                                  must_exist=resume,
                                                  direction=kind.metrics.direction_of(loaded.objective))
        self.datasets = DatasetCache(kind)
        self.dir = settings.home() / "research" / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.parent_run_id = self._parent_run()

    # ---- parent run -------------------------------------------------------------------------
    def _parent_run(self) -> str:
        self.tracker.describe(self.loaded.task, self.kind.metrics, params=list(self.cfg.space),
                              objective=self.loaded.objective)
        run_id = study_attr(self.study, ATTR_PARENT_RUN)
        if run_id is None and not (self.created or self.resume):
            # The creating process writes it right after creating the study; give it a moment.
            deadline = time.monotonic() + 60
            while run_id is None and time.monotonic() < deadline:
                time.sleep(0.5)
                run_id = study_attr(self.study, ATTR_PARENT_RUN)
        if run_id is None:
            run_id = self.tracker.create_parent(redact(self.url), space_fingerprint(self.cfg.space))
            self.study.set_user_attr(ATTR_PARENT_RUN, run_id)
            self.tracker.log_params(run_id, flat_config(self.loaded))
        return run_id

    # ---- interrupted trials -----------------------------------------------------------------
    def _on_interrupted(self, study: optuna.Study, trial: FrozenTrial) -> None:
        retried = retry_trial(study, trial, self.cfg.max_retries)
        run_id = trial.user_attrs.get("mlflow_run_id")
        if run_id:
            with contextlib.suppress(Exception):
                reason = "interrupted: its process died" + ("; configuration queued again" if retried else "")
                self.tracker.finish_trial(run_id, "failed", reason)

    def recover(self) -> list[int]:
        recovered = recover_dead_local_trials(self.study, self._on_interrupted)
        fail_stale(self.study)
        self.reconcile()
        return recovered

    def reconcile(self) -> None:
        """MLflow runs left RUNNING by a dead process get the final state Optuna has for their trial."""
        trials = {t.number: t for t in self.study.get_trials(deepcopy=False)}
        for number, run in self.tracker.trial_runs(self.parent_run_id).items():
            trial = trials.get(number)
            if run.info.status != "RUNNING" or trial is None or trial.state not in TERMINAL:
                continue
            reason = trial.user_attrs.get("fail_reason") or ("interrupted: its process died"
                                                              if trial.state == TrialState.FAIL else None)
            self.tracker.finish_trial(run.info.run_id, TERMINAL[trial.state], reason)

    # ---- the config's own point -------------------------------------------------------------
    def enqueue_config(self) -> tuple[dict[str, Any], list[str]] | None:
        """Queue the `train:` section as written as the study's first trial (only in a study this process just
        created, so no resume or second process queues it again). Returns (point, paths sampled instead)."""
        if not (self.created and self.cfg.start_from_config):
            return None
        point, outside = config_point(self.cfg.space, self.kind.parse_config(self.loaded.train_raw))
        if point:
            self.study.enqueue_trial(point, user_attrs={"from_config": True})
        return point, outside

    # ---- baseline ---------------------------------------------------------------------------
    def baseline(self) -> dict[str, float]:
        stored = study_attr(self.study, ATTR_BASELINE)
        if stored:
            return dict(stored)
        train_cfg = self.kind.parse_config(self.loaded.train_raw)
        dataset = self.datasets.get(train_cfg)
        metrics = {k: float(v) for k, v in self.kind.baselines(train_cfg, dataset).items()}
        # Two processes may race here; both computed the same numbers, the parent gets them once.
        if study_attr(self.study, ATTR_BASELINE) is None:
            self.study.set_user_attr(ATTR_BASELINE, metrics)
            self.tracker.log_headline(self.parent_run_id, metrics, self.kind.metrics)  # the rest: summary table
            self.tracker.set_tags(self.parent_run_id, {"lorafleet.dataset_digest": getattr(dataset, "digest", "")})
            self.tracker.log_dataset(self.parent_run_id, dataset, self.loaded.task)
        return metrics

    def judged_baseline(self, cfg: Any, variants: Sequence[Any]) -> tuple[dict[str, float], str]:
        """What `cfg` (the winner's config) is judged against, and the digest of the data it was measured on: the
        kind's baselines of `cfg`'s own baseline key (the study's when that is the `train:` section's key; else
        computed here, on `cfg`'s own dataset) and its rivals among `variants` (the space's other choices).

        Stored in the study per key, so a resume or another process judges the same winner alike."""
        key = self.kind.baseline_key(cfg)
        attr = f"{ATTR_JUDGED}:{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        stored = study_attr(self.study, attr)
        if stored:
            return {k: float(v) for k, v in stored["metrics"].items()}, str(stored.get("digest") or "")
        dataset = self.datasets.get(cfg)
        if self.kind.baseline_key(self.kind.parse_config(self.loaded.train_raw)) == key:
            metrics = self.baseline()
        else:
            metrics = {k: float(v) for k, v in self.kind.baselines(cfg, dataset).items()}
        metrics.update({k: float(v) for k, v in self.kind.rivals(cfg, dataset, variants).items()})
        digest = str(getattr(dataset, "digest", "") or "")
        self.study.set_user_attr(attr, {"key": key, "digest": digest, "metrics": metrics})
        return metrics, digest

    # ---- trials -----------------------------------------------------------------------------
    def run_trials(self, n_trials: int, deadline: float, baseline: dict[str, float], progress: Progress) -> None:
        objective = TrialObjective(
            loaded=self.loaded, kind=self.kind, tracker=self.tracker, parent_run_id=self.parent_run_id,
            trials_dir=self.dir, deadline=deadline, progress=progress, datasets=self.datasets, baseline=baseline,
            counted=lambda: counted_trials(self.study),
        )
        reopened = False
        while True:
            self.recover()
            if counted_trials(self.study) >= n_trials and not self._waiting():
                break
            if deadline - time.monotonic() < 1:
                progress.note("[research] budget spent; stopping before the next trial")
                break
            if not reopened:  # a summarised (FINISHED) or killed parent shows RUNNING again while trials run
                self.tracker.reopen(self.parent_run_id)
                reopened = True
            self.study.optimize(objective, n_trials=1, catch=(Exception,), gc_after_trial=True)

    def _waiting(self) -> bool:
        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def wait_for_others(self, progress: Progress, timeout_s: float) -> bool:
        """Before the summary: let trials of other processes finish (or be failed by the heartbeat)."""
        deadline = time.monotonic() + timeout_s
        noted = False
        while self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if time.monotonic() > deadline:
                return False
            if not noted:
                progress.note("[research] waiting for trials of other processes to finish")
                noted = True
            time.sleep(2)
            self.recover()
        return True

    # ---- finalisation -----------------------------------------------------------------------
    def already_summarised(self) -> bool:
        """A summary covers every trial, and it holds the whole winner (a summary written before it kept the
        winner's config and metrics is written again: its test look is reused, nothing is evaluated twice)."""
        done = study_attr(self.study, ATTR_FINALIZED)
        return (bool(done) and done.get("trials") == len(self.study.get_trials(deepcopy=False))
                and (done.get("winner_trial") is None or "winner_config" in done))

    def claim_finalize(self, force: bool) -> bool:
        """At most one process writes the summary (the first claim wins; the claim names the trials it covers).

        `force` (resume) takes over a claim whose process died while writing the summary."""
        n = len(self.study.get_trials(deepcopy=False))
        me = {"worker": worker_id(), "trials": n, "at": time.time()}
        claim = study_attr(self.study, ATTR_FINALIZE_CLAIM)
        if (claim and claim.get("trials") == n and claim.get("worker") != me["worker"]
                and time.time() - claim.get("at", 0) < 3600 and not force):
            return False
        self.study.set_user_attr(ATTR_FINALIZE_CLAIM, me)
        time.sleep(1.0)  # a simultaneous claim lands within this window; both then read the same winner
        return (study_attr(self.study, ATTR_FINALIZE_CLAIM) or {}).get("worker") == me["worker"]


@contextlib.contextmanager
def _local_init_lock() -> Iterator[None]:
    """Serialise opening the stores between local processes: two processes creating the same fresh
    sqlite schema (MLflow's or Optuna's) at once make one of them fail. Remote stores migrate once, elsewhere."""
    import fcntl

    with (settings.home() / ".research-init.lock").open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


