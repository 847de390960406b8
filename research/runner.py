"""`run_research`: baseline → Optuna trials → winner on dev → test + second seed → verdict.

State is in the Optuna storage (trials, the config snapshot, the MLflow parent run id, the
baseline) and in MLflow (everything a human looks at). Any number of processes may drive one
study; the last one to finish its trials writes the summary. `resume` continues a study after a
crash: trials of dead processes are failed and their configurations queued again.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from lorafleet import settings

from .config import LoadedConfig, from_raw, space_fingerprint
from .objective import DatasetCache, TrainAPI, TrialObjective
from .progress import Progress
from .study import (
    ATTR_BASELINE,
    ATTR_CONFIG,
    ATTR_FINALIZE_CLAIM,
    ATTR_FINALIZED,
    ATTR_PARENT_RUN,
    StudyError,
    counted_trials,
    fail_stale,
    jsonable,
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


@dataclass
class ResearchResult:
    """What a research run produced. `candidate` is True only for a winner that beat the base by the margin.

    The ship step (tune + register) takes `winner_adapter_dir`, `winner_config` and the metrics from here.
    """

    study: str
    storage: str
    experiment: str
    parent_run_id: str
    objective: str
    baseline: dict[str, float] = field(default_factory=dict)
    winner_trial: int | None = None
    winner_params: dict[str, Any] = field(default_factory=dict)
    winner_config: dict[str, Any] = field(default_factory=dict)
    winner_adapter_dir: str | None = None
    winner_metrics: dict[str, float] = field(default_factory=dict)  # dev_* and test_* of the winner
    reseed_metrics: dict[str, float] = field(default_factory=dict)  # the same, second seed
    spread: dict[str, float] = field(default_factory=dict)
    candidate: bool = False
    verdict: str = ""
    finalized: bool = False
    report_path: str | None = None
    trials: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return jsonable(self.__dict__)


def _snapshot(loaded: LoadedConfig) -> dict[str, Any]:
    return {"train": loaded.train_raw, "research": loaded.research.model_dump(mode="json"), "source": loaded.source}


def loaded_from_study(name: str, storage: str | None = None, train_model: type | None = None) -> LoadedConfig:
    """The config a study was started with (stored in the study), so `resume NAME` needs no YAML."""
    url = storage_url(storage)
    try:
        summaries = optuna.get_all_study_summaries(storage=url, include_best_trial=False)
    except Exception as exc:
        raise StudyError(f"cannot read Optuna storage {url}: {exc}") from exc
    match = [s for s in summaries if s.study_name == name]
    if not match:
        known = ", ".join(sorted(s.study_name for s in summaries)) or "none"
        raise StudyError(f"no study named {name!r} in {url} (studies there: {known})")
    snap = match[0].user_attrs.get(ATTR_CONFIG)
    if not snap:
        raise StudyError(f"study {name!r} has no stored lorafleet config; it was not started by `research run`")
    return from_raw(snap["train"], snap["research"], f"study {name}", train_model)


class _Session:
    """One process driving one study."""

    def __init__(self, loaded: LoadedConfig, api: TrainAPI, *, storage: str | None, resume: bool,
                 worker_only: bool, progress_live: bool | None) -> None:
        self.loaded, self.api, self.cfg = loaded, api, loaded.research
        self.name = self.cfg.study
        self.url = storage_url(storage)
        self.resume, self.worker_only, self.progress_live = resume, worker_only, progress_live
        with _local_init_lock():
            self.tracker = Tracker(self.name)
            self.storage = make_storage(self.url, self.cfg, on_stale=self._on_interrupted)
            self.study, self.created = open_study(self.name, self.storage, self.cfg, _snapshot(loaded),
                                                  must_exist=resume)
        self.datasets = DatasetCache(api)
        self.dir = settings.home() / "research" / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.parent_run_id = self._parent_run()

    # ---- parent run -------------------------------------------------------------------------
    def _parent_run(self) -> str:
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
            self.tracker.log_params(run_id, _flat_config(self.loaded))
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

    # ---- baseline ---------------------------------------------------------------------------
    def baseline(self) -> dict[str, float]:
        stored = study_attr(self.study, ATTR_BASELINE)
        if stored:
            return dict(stored)
        train_cfg = self.api.TrainConfig.model_validate(self.loaded.train_raw)
        dataset = self.datasets.get(train_cfg)
        model = _load_base(self.api, train_cfg)
        metrics: dict[str, float] = {}
        for split in ("dev", "test"):
            metrics.update({f"base_{k}": float(v) for k, v in self.api.evaluate_model(model, dataset, split).items()})
            metrics.update({f"bm25_{k}": float(v) for k, v in self.api.evaluate_bm25(dataset, split).items()})
        # Two processes may race here; both computed the same numbers, the parent gets them once.
        if study_attr(self.study, ATTR_BASELINE) is None:
            self.study.set_user_attr(ATTR_BASELINE, metrics)
            self.tracker.log_metrics(self.parent_run_id, metrics)
            self.tracker.set_tags(self.parent_run_id, {"lorafleet.dataset_digest": getattr(dataset, "digest", "")})
        return metrics

    # ---- trials -----------------------------------------------------------------------------
    def run_trials(self, n_trials: int, deadline: float, baseline: dict[str, float], progress: Progress) -> None:
        objective = TrialObjective(
            loaded=self.loaded, api=self.api, tracker=self.tracker, parent_run_id=self.parent_run_id,
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
        done = study_attr(self.study, ATTR_FINALIZED)
        return bool(done) and done.get("trials") == len(self.study.get_trials(deepcopy=False))

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


def _load_base(api: TrainAPI, train_cfg: Any) -> Any:
    if api.load_base_model is not None:
        return api.load_base_model(train_cfg)
    from sentence_transformers import SentenceTransformer

    from lorafleet.models import resolve_model_source

    device = getattr(train_cfg, "device", "cpu")
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = SentenceTransformer(resolve_model_source(train_cfg.base_model), device=device)
    model.max_seq_length = train_cfg.max_seq_length
    return model


def _flat_config(loaded: LoadedConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            out[prefix[:-1]] = json.dumps(node) if isinstance(node, list) else node

    walk("train.", loaded.train_raw)
    walk("research.", {k: v for k, v in loaded.research.model_dump(mode="json").items() if k != "space"})
    out["research.space"] = json.dumps(loaded.research.model_dump(mode="json")["space"], sort_keys=True)
    return out


def run_research(loaded: LoadedConfig, *, n_trials: int | None = None, budget_minutes: float | None = None,
                 storage: str | None = None, resume: bool = False, worker_only: bool = False,
                 api: TrainAPI | None = None, progress_live: bool | None = None) -> ResearchResult:
    """Drive the study named in `loaded.research.study` and, unless `worker_only`, write its summary.

    The returned result's `candidate` says whether the winner may be shipped (tuned + registered);
    that next step belongs to the caller (see `lorafleet.research.cli`).
    """
    from .finalize import finalize

    cfg = loaded.research
    if n_trials is not None:
        if n_trials < 1:
            raise StudyError(f"--trials must be at least 1, got {n_trials}")
        cfg = cfg.model_copy(update={"n_trials": n_trials})
    if budget_minutes is not None:
        if budget_minutes <= 0:
            raise StudyError(f"--budget-minutes must be positive, got {budget_minutes}")
        cfg = cfg.model_copy(update={"budget_minutes": budget_minutes})
    loaded = loaded.model_copy(update={"research": cfg})
    api = api or TrainAPI.default()
    t0 = time.monotonic()
    deadline = t0 + cfg.budget_minutes * 60

    session = _Session(loaded, api, storage=storage, resume=resume, worker_only=worker_only,
                       progress_live=progress_live)
    result = ResearchResult(study=session.name, storage=redact(session.url),
                            experiment=session.tracker.experiment_id, parent_run_id=session.parent_run_id,
                            objective=cfg.objective)
    with Progress(session.name, cfg.n_trials, deadline, cfg.objective, live=progress_live) as progress:
        recovered = session.recover()
        if recovered:
            progress.note(f"[research] trials {recovered} were interrupted; marked failed, configurations queued again")
        progress.note(f"[research] study {session.name!r} ({'new' if session.created else 'continued'}), "
                      f"MLflow parent run {session.parent_run_id}, pid {os.getpid()}")
        baseline: dict[str, float] = {}
        if session.created or resume:  # a process joining a running study leaves the baseline to its creator
            progress.note("[research] evaluating the baseline (base model, BM25) on dev and test")
            baseline = session.baseline()
            progress.note(f"[research] baseline: base {cfg.objective}={baseline.get('base_' + cfg.objective, 0):.4f}, "
                          f"bm25 {cfg.objective}={baseline.get('bm25_' + cfg.objective, 0):.4f}")
        else:
            baseline = dict(study_attr(session.study, ATTR_BASELINE) or {})
        best = winner_of(session.study)
        progress.best = None if best is None else (best.number, float(best.value))
        session.run_trials(cfg.n_trials, deadline, baseline, progress)
        result.baseline = baseline
        result.trials = _counts(session.study)
        if worker_only:
            return result
        if not session.wait_for_others(progress, timeout_s=cfg.trial_timeout_minutes * 60 + cfg.grace_s):
            progress.note("[research] other processes are still running trials; the last one writes the summary")
            return result
        if session.already_summarised():
            done = study_attr(session.study, ATTR_FINALIZED)
            result.verdict, result.candidate = done.get("verdict", ""), bool(done.get("candidate"))
            result.winner_trial, result.winner_adapter_dir = done.get("winner_trial"), done.get("winner_adapter_dir")
            progress.note(f"[research] study {session.name!r} is already summarised and has no new trials; "
                          f"see MLflow parent run {session.parent_run_id}")
            return result
        if not session.claim_finalize(force=resume):
            progress.note("[research] another process writes the summary of this study")
            return result
        finalize(session, result, progress)
    return result


def _counts(study: optuna.Study) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        out[t.state.name.lower()] = out.get(t.state.name.lower(), 0) + 1
    return out


def winner_of(study: optuna.Study) -> FrozenTrial | None:
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    return max(complete, key=lambda t: (t.value, -t.number)) if complete else None
