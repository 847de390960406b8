"""The end of a research run: pick the winner on dev, test it and the baseline, re-train it with a
second seed, decide whether it is a candidate, and write the summary to the MLflow parent run.

Honest evaluation: trials see dev only; test is scored once per study, for the winner (and its second
seed), through the kind's `evaluate`. That look is recorded in the study (keyed by study id and dataset
digest) and on the parent run, and a later finalisation (`research resume` with more trials) reuses it:
it never evaluates test again, even when another trial has since taken the lead on dev.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial

from lorafleet.core.metrics import prefixed, to_test
from lorafleet.core.tasks import beats

from .config import apply_params, space_variants
from .objective import metrics_of
from .progress import Progress
from .report import render_markdown, save_plots
from .result import ResearchResult
from .session import Session
from .study import (
    ATTR_ADAPTER_ARTIFACT,
    ATTR_FINALIZED,
    decode_params,
    jsonable,
    study_attr,
    study_uid,
    tested_key,
    tested_records,
    trial_counts,
    trials_table,
    winner_of,
)
from .tracking import PARENT_TAG, TAG_DESCRIPTION, TAG_ROLE

TAG_TESTED = "lorafleet.test_evaluated"  # on the parent run: which trial test was evaluated for, once

ATTR_RESEED = "reseed"


def _evaluate_test(session: Session, train_cfg: Any, adapter_dir: str) -> tuple[dict[str, float], str]:
    """The adapter's metrics on test, through the kind (the only way research reads test), and the digest of
    the dataset they were measured on."""
    dataset = session.datasets.get(train_cfg)
    metrics = session.kind.evaluate(train_cfg, dataset, Path(adapter_dir), "test")
    return {k: float(v) for k, v in metrics.items()}, str(getattr(dataset, "digest", "") or "")


def _tested(session: Session) -> dict[str, Any] | None:
    """The study's one look at test, if it had it (the earliest record, should there ever be two)."""
    records = tested_records(session.study).values()
    return min(records, key=lambda r: r.get("at", 0.0)) if records else None


def _test_winner(session: Session, winner: FrozenTrial, train_cfg: Any, adapter_dir: str, progress: Progress
                 ) -> dict[str, float]:
    """Score the winner on test, once per study: record it (study attr keyed by study id and dataset digest,
    tag on the parent run) before anything shows the numbers, so that no later finalisation looks again."""
    progress.note(f"[research] evaluating trial #{winner.number} on test (once for this study)")
    test, digest = _evaluate_test(session, train_cfg, adapter_dir)
    uid = study_uid(session.study)
    session.study.set_user_attr(tested_key(uid, digest), {
        "trial": winner.number, "study_uid": uid, "dataset_digest": digest,
        "trained_on": winner.user_attrs.get("dataset_digest") or "", "metrics": test, "at": time.time()})
    session.tracker.set_tags(session.parent_run_id, {
        TAG_TESTED: f"once, for trial #{winner.number} (study {uid}, dataset {digest})"})
    return test


def _reseed(session: Session, winner_number: int, train_cfg: Any, progress: Progress) -> dict[str, float]:
    """Train the winner's configuration again with another seed (once per winner; reused on resume)."""
    stored = study_attr(session.study, ATTR_RESEED)
    if stored and stored.get("trial") == winner_number:
        return dict(stored["metrics"])
    tracker = session.tracker
    for run in tracker.client.search_runs(
        [tracker.experiment_id],
        f"tags.`{TAG_ROLE}` = 'reseed' and tags.`{PARENT_TAG}` = '{session.parent_run_id}' "
        "and attributes.status = 'RUNNING'",
    ):
        tracker.finish_trial(run.info.run_id, "failed", "interrupted: its process died")
    seed_cfg = train_cfg.model_copy(update={"seed": train_cfg.seed + 1})
    run_id = tracker.create_child(session.parent_run_id, "reseed", f"trial-{winner_number:03d}-seed{seed_cfg.seed}",
                                  {"winner_trial": winner_number, "seed": seed_cfg.seed})
    progress.note(f"[research] re-training trial #{winner_number}'s configuration with seed {seed_cfg.seed}")
    objective = session.loaded.objective
    try:
        result = session.kind.train(
            seed_cfg, session.datasets.get(seed_cfg), session.dir / f"winner-{winner_number:03d}-seed{seed_cfg.seed}",
            on_epoch=lambda epoch, m: tracker.log_metrics(run_id, {objective: m[objective]}, step=epoch),
        )
        metrics = {k: float(v) for k, v in metrics_of(result).items() if k.startswith("dev_")}
        metrics.update(_evaluate_test(session, seed_cfg, str(result.adapter_dir))[0])
    except BaseException as exc:
        with contextlib.suppress(Exception):
            tracker.finish_trial(run_id, "failed", f"{type(exc).__name__}: {exc}")
        raise
    # Like a trial: the headline (the objective already went in per epoch), the rest in the run's table.
    spec, cost = session.kind.metrics, dict(getattr(result, "cost", None) or {})
    tracker.log_headline(run_id, {**{k: v for k, v in metrics.items() if k != objective}, **prefixed(cost, "cost")},
                         spec)
    tracker.log_table(run_id, spec.rows(metrics) + spec.rows(prefixed(cost, "cost")))
    tracker.log_dataset(run_id, session.datasets.get(seed_cfg), session.loaded.task)
    tracker.finish_trial(run_id, "complete")
    session.study.set_user_attr(ATTR_RESEED, {"trial": winner_number, "metrics": metrics})
    return metrics


def winner_adapter(session: Session, trial: FrozenTrial) -> tuple[str, str | None]:
    """The winning trial's adapter as a folder on this machine, and where it came from (`runs:/RUN/adapter`).

    Taken from the trial's MLflow run: with several processes (or machines) on one study, the trial may have
    run elsewhere, and the path it recorded is that process's. Trials from before adapters were logged to
    their runs: that recorded path."""
    run_id, artifact = trial.user_attrs.get("mlflow_run_id"), trial.user_attrs.get(ATTR_ADAPTER_ARTIFACT)
    if not run_id or not artifact:
        return str(trial.user_attrs["adapter_dir"]), None
    dest = session.dir / "winner" / f"trial-{trial.number:03d}"
    return str(session.tracker.download_artifacts(run_id, artifact, dest)), f"runs:/{run_id}/{artifact}"


# What a summary keeps of its result in the study, so that a later `research resume` (e.g. after shipping failed)
# hands the pipeline the same winner to ship: its config, metrics and data digest, not only its verdict.
SUMMARY_FIELDS = ("candidate", "verdict", "winner_trial", "winner_params", "winner_config", "winner_adapter_dir",
                  "winner_adapter_uri", "winner_metrics", "reseed_metrics", "spread", "dataset_digest", "report_path",
                  "baseline", "margin")


def restore_summary(result: ResearchResult, done: dict[str, Any]) -> ResearchResult:
    """Fill `result` from a stored summary (studies summarised before SUMMARY_FIELDS grew keep their defaults)."""
    for key in SUMMARY_FIELDS:
        if key in done:
            setattr(result, key, done[key])
    return result


def finalize(session: Session, result: ResearchResult, progress: Progress) -> ResearchResult:
    cfg = session.cfg
    study = session.study
    objective, test_obj = session.loaded.objective, to_test(session.loaded.objective)
    session.reconcile()
    baseline = session.baseline()
    result.baseline = baseline
    result.margin = cfg.min_margin
    result.trials = trial_counts(study)
    winner = winner_of(study)
    tested = _tested(session)
    note = ""
    if winner is not None and tested is not None and tested.get("trial") != winner.number:
        # Test was looked at once, for the winner of its time; a later dev winner is not tested (that would be a
        # second look, picking among test results). The verdict stands; a fresh one needs fresh data.
        note = (f"trial #{winner.number} now leads on dev, but this study's test split was already used, for "
                f"trial #{tested['trial']}, so that trial stays the study's winner and verdict")
        winner = next(t for t in study.get_trials(deepcopy=False) if t.number == tested["trial"])
    if winner is None:
        result.verdict = "no trial completed, so there is no winner and no candidate"
    else:
        params = decode_params(cfg.space, winner.params)
        train_cfg = apply_params(session.loaded.train_raw, params, session.kind.config_model)
        adapter_dir, result.winner_adapter_uri = winner_adapter(session, winner)
        progress.note(f"[research] winner on dev: trial #{winner.number} ({objective}={winner.value:.4f})")
        dev = {k: float(v) for k, v in (winner.user_attrs.get("dev_metrics") or {}).items()}
        result.winner_trial, result.winner_params = winner.number, params
        result.winner_config = train_cfg.model_dump(mode="json")
        result.winner_adapter_dir = adapter_dir
        result.dataset_digest = winner.user_attrs.get("dataset_digest") or None
        if tested is not None:
            progress.note(f"[research] test was evaluated for trial #{tested['trial']} already (dataset "
                          f"{str(tested.get('dataset_digest', ''))[:12]}); reusing that result, not looking again")
            test = {k: float(v) for k, v in tested["metrics"].items()}
        else:
            test = _test_winner(session, winner, train_cfg, adapter_dir, progress)
        result.winner_metrics = {**dev, **test}
        if cfg.reseed:
            result.reseed_metrics = _reseed(session, winner.number, train_cfg, progress)
            for key in (objective, test_obj):
                if key in result.winner_metrics and key in result.reseed_metrics:
                    result.spread[key] = abs(result.winner_metrics[key] - result.reseed_metrics[key])
        # Judged against its own configuration's baselines (its data, and for rerank its own first stage and
        # depth), not the `train:` section's, and against the kind's rivals among the space's other choices.
        spec = session.kind.metrics
        variants = space_variants(cfg.space, session.loaded.train_raw, params, session.kind.config_model)
        if session.kind.baseline_key(train_cfg) != session.kind.baseline_key(
                session.kind.parse_config(session.loaded.train_raw)) or spec.rivals:
            progress.note(f"[research] scoring the baselines trial #{winner.number} is judged against "
                          f"({', '.join(label for _, label in spec.gates)})")
        judged, judged_digest = session.judged_baseline(train_cfg, variants)
        result.baseline = judged
        if result.dataset_digest and judged_digest and judged_digest != result.dataset_digest:
            result.candidate, result.verdict = False, (
                f"no candidate: trial #{winner.number} was scored on dataset {result.dataset_digest[:12]}, its "
                f"baselines on dataset {judged_digest[:12]}: the numbers are not comparable")
        else:
            result.candidate, result.verdict = _verdict(cfg.min_margin, objective, spec.direction_of(objective),
                                                        judged, result, spec.gates)
        if note:
            progress.note(f"[research] {note}")
            result.verdict += f" ({note})"
    _write_summary(session, result)
    summary = {k: v for k, v in result.to_json().items() if k in SUMMARY_FIELDS}
    study.set_user_attr(ATTR_FINALIZED, {"trials": len(study.get_trials(deepcopy=False)), "at": time.time(),
                                         **summary})
    result.finalized = True
    progress.note(f"[research] {result.verdict}")
    return result


def _verdict(margin: float, objective: str, direction: str, baseline: dict[str, float], result: ResearchResult,
             gates: Sequence[tuple[str, str]] = (("base", "the base model"),)) -> tuple[bool, str]:
    """Candidate only if the winner on dev and every seed on test beat each of `gates` ((prefix, words): the base
    model, or the kind's best baseline, and its rivals) by the relative margin, strictly (a tie is no win).

    The margin means what it means in the promotion gate (lorafleet.core.tasks.beats): a share of the reference's score.
    """
    test_obj = to_test(objective)
    tests = [m[test_obj] for m in (result.winner_metrics, result.reseed_metrics) if test_obj in m]
    if not tests:
        return False, f"the winner has no {test_obj}, so it cannot be judged; no candidate"
    worst_test = min(tests) if direction == "maximize" else max(tests)
    dev = result.winner_metrics.get(objective, float("nan"))
    seeds = f"{len(tests)} seed(s)"
    beaten, missed = [], []
    for prefix, label in gates:
        ref_dev, ref_test = baseline.get(f"{prefix}_{objective}"), baseline.get(f"{prefix}_{test_obj}")
        if ref_dev is None or ref_test is None:
            return False, (f"baseline metrics are missing ({prefix}_{objective}, {prefix}_{test_obj}: {label}), "
                           "so the winner cannot be judged; no candidate")
        ok = (beats(dev, ref_dev, margin, direction)  # type: ignore[arg-type]
              and beats(worst_test, ref_test, margin, direction))  # type: ignore[arg-type]
        (beaten if ok else missed).append(f"{label} (dev {ref_dev:.4f}, test {ref_test:.4f})")
    if not missed:
        ref_test = max(baseline[f"{p}_{test_obj}"] for p, _ in gates) if direction == "maximize" else \
            min(baseline[f"{p}_{test_obj}"] for p, _ in gates)
        gain = (worst_test / ref_test - 1) * 100 if ref_test else float("inf")
        return True, (f"candidate: trial #{result.winner_trial} beats {' and '.join(beaten)} on test by {gain:+.1f}% "
                      f"(worst of {seeds}: {test_obj}={worst_test:.4f}, dev {dev:.4f}; margin {margin:.0%}, "
                      "strictly)")
    return False, (f"no candidate: the winner (trial #{result.winner_trial}, dev {dev:.4f}, worst test of {seeds} "
                   f"{worst_test:.4f}) does not beat {' nor '.join(missed)} by the {margin:.0%} margin (a tie is no "
                   "win)" + (f"; it does beat {' and '.join(beaten)}" if beaten else ""))


def _write_summary(session: Session, result: ResearchResult) -> None:
    tracker, parent, cfg = session.tracker, session.parent_run_id, session.cfg
    out = session.dir / "summary"
    out.mkdir(parents=True, exist_ok=True)
    plots = save_plots(session.study, out)
    rows = trials_table(session.study, cfg.space)
    report = out / "report.md"
    report.write_text(render_markdown(result, rows, cfg.model_dump(mode="json"), [p.name for p in plots]))
    (out / "summary.json").write_text(json.dumps({"result": result.to_json(), "trials": jsonable(rows)}, indent=2))
    result.report_path = str(report)
    # The parent run is the study's result: the winner's headline under the same names a trial uses
    # (`dev_ndcg@10`, `test_ndcg@10`), beside the baseline's (logged once by Session.baseline) and the
    # trials' total time; every other number (all metrics of base, baseline, winner and its second seed,
    # the seed spread, trial counts) goes to the parent's table and the report.
    spec = session.kind.metrics
    wall = sum(float(t.user_attrs.get("wall_s") or 0.0) for t in session.study.get_trials(deepcopy=False))
    if result.baseline != session.baseline():  # the winner's own baselines: the parent shows what it was judged by
        tracker.log_headline(parent, result.baseline, spec)
    tracker.log_headline(parent, {**result.winner_metrics, "cost_wall_s": wall}, spec)
    tracker.log_table(parent, spec.rows(result.baseline) + spec.rows(result.winner_metrics, model="winner")
                      + spec.rows(result.reseed_metrics, model="winner, seed 2")
                      + spec.rows(result.spread, model="seed spread")
                      + spec.rows({f"trials_{k}": float(v) for k, v in result.trials.items()}, model="study"))
    tracker.set_tags(parent, {
        "lorafleet.candidate": str(result.candidate).lower(), "lorafleet.verdict": result.verdict[:4000],
        "lorafleet.best_trial": "" if result.winner_trial is None else result.winner_trial,
        "lorafleet.winner_adapter_dir": result.winner_adapter_dir or "",
        "lorafleet.winner_adapter_uri": result.winner_adapter_uri or "",
        "lorafleet.trials": ", ".join(f"{k} {v}" for k, v in result.trials.items()),
    })
    summary = spec.summary({**result.baseline, **result.winner_metrics})
    tracker.set_tags(parent, {TAG_DESCRIPTION: f"{summary} (trial #{result.winner_trial}). {result.verdict}"
                              if summary else result.verdict})
    for path in [*plots, report, out / "summary.json"]:
        tracker.log_artifact(parent, Path(path))
    tracker.terminate(parent, "FINISHED")
