"""`run_research`: baseline → Optuna trials → winner on dev → test + second seed → verdict.

State is in the Optuna storage (trials, the config snapshot, the MLflow parent run id, the
baseline) and in MLflow (everything a human looks at). Any number of processes may drive one
study; the last one to finish its trials writes the summary. `resume` continues a study after a
crash: trials of dead processes are failed and their configurations queued again. What the
trials train and how they are judged comes from the task kind (lorafleet.core.tasks).
"""

from __future__ import annotations

import os
import time

import optuna

from lorafleet.core.tasks import TaskKind

from .config import DEFAULT_TASK, LoadedConfig, from_raw, task_kind
from .finalize import finalize, restore_summary
from .progress import Progress
from .result import ResearchResult
from .session import Session
from .study import (
    ATTR_BASELINE,
    ATTR_CONFIG,
    ATTR_FINALIZED,
    StudyError,
    redact,
    storage_url,
    study_attr,
    trial_counts,
    winner_of,
)


def loaded_from_study(name: str, storage: str | None = None) -> LoadedConfig:
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
    return from_raw(snap["train"], snap["research"], f"study {name}", snap.get("task") or DEFAULT_TASK)


def run_research(loaded: LoadedConfig, *, n_trials: int | None = None, budget_minutes: float | None = None,
                 storage: str | None = None, resume: bool = False, worker_only: bool = False,
                 kind: TaskKind | None = None, progress_live: bool | None = None) -> ResearchResult:
    """Drive the study named in `loaded.research.study` and, unless `worker_only`, write its summary.

    The returned result's `candidate` says whether the winner may be shipped (tuned + registered);
    that next step belongs to the caller (`lorafleet.pipeline`). `kind` defaults to the config's task kind.
    """
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
    kind = kind or task_kind(loaded.task)
    t0 = time.monotonic()
    deadline = t0 + cfg.budget_minutes * 60

    session = Session(loaded, kind, storage=storage, resume=resume, worker_only=worker_only,
                       progress_live=progress_live)
    result = ResearchResult(study=session.name, storage=redact(session.url),
                            experiment=session.tracker.experiment_id, parent_run_id=session.parent_run_id,
                            objective=loaded.objective, task=loaded.task)
    with Progress(session.name, cfg.n_trials, deadline, loaded.objective, live=progress_live) as progress:
        recovered = session.recover()
        if recovered:
            progress.note(f"[research] trials {recovered} were interrupted; marked failed, configurations queued again")
        progress.note(f"[research] study {session.name!r} ({'new' if session.created else 'continued'}), "
                      f"MLflow parent run {session.parent_run_id}, pid {os.getpid()}")
        queued = session.enqueue_config()
        if queued is not None and queued[0]:
            point, outside = queued
            progress.note("[research] the first trial trains the config as written: "
                          + ", ".join(f"{k}={v}" for k, v in point.items())
                          + (f" (sampled: {', '.join(outside)}: the config's value is outside the space)"
                             if outside else ""))
        baseline: dict[str, float] = {}
        if session.created or resume:  # a process joining a running study leaves the baseline to its creator
            label = kind.metrics.baseline_label
            progress.note(f"[research] evaluating the baselines (the base model, {label}) on dev and test")
            baseline = session.baseline()
            obj, other = loaded.objective, kind.metrics.baseline
            progress.note(f"[research] baseline: base {obj}={baseline.get('base_' + obj, float('nan')):.4f}"
                          + (f", {other} {obj}={baseline.get(f'{other}_{obj}', float('nan')):.4f}" if other else "")
                          + (f", {kind.metrics.gate_label} {obj}={baseline.get(f'{gate}_{obj}', float('nan')):.4f}"
                             if (gate := kind.metrics.gate) not in ("base", other) else ""))
        else:
            baseline = dict(study_attr(session.study, ATTR_BASELINE) or {})
        best = winner_of(session.study)
        progress.best = None if best is None else (best.number, float(best.value))
        session.run_trials(cfg.n_trials, deadline, baseline, progress)
        result.baseline = baseline
        result.trials = trial_counts(session.study)
        if worker_only:
            return result
        if not session.wait_for_others(progress, timeout_s=cfg.trial_timeout_minutes * 60 + cfg.grace_s):
            progress.note("[research] other processes are still running trials; the last one writes the summary")
            return result
        if session.already_summarised():
            restore_summary(result, study_attr(session.study, ATTR_FINALIZED))
            result.candidate = bool(result.candidate)
            progress.note(f"[research] study {session.name!r} is already summarised and has no new trials; "
                          f"see MLflow parent run {session.parent_run_id}")
            return result
        if not session.claim_finalize(force=resume):
            progress.note("[research] another process writes the summary of this study")
            return result
        finalize(session, result, progress)
    return result
