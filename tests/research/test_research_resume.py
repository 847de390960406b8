"""SIGKILL in the middle of a trial, then `lorafleet research resume NAME`."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from research_testkit import start_cli, storage_url

pytestmark = pytest.mark.integration


def _wait_for_running_trial(url: str, study: str, proc: object, log: Path, timeout_s: float = 180) -> int:
    """Wait until one trial is complete and the next one is RUNNING (mid-training); return its number."""
    import optuna

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"research run exited early:\n{log.read_text()[-3000:]}"  # type: ignore[attr-defined]
        try:
            trials = optuna.load_study(study_name=study, storage=url).get_trials(deepcopy=False)
        except (KeyError, Exception):
            trials = []
        done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
        running = [t for t in trials if t.state == optuna.trial.TrialState.RUNNING and "mlflow_run_id" in t.user_attrs]
        if done and running:
            return running[0].number
        time.sleep(0.2)
    raise AssertionError(f"no trial reached RUNNING in time:\n{log.read_text()[-3000:]}")


def test_resume_after_sigkill(research_yaml: Callable[..., Path], _isolated_home: Path, tmp_path: Path) -> None:
    import mlflow
    import optuna
    from typer.testing import CliRunner

    from lorafleet.cli import app
    from lorafleet.core import settings
    from lorafleet.research.tracking import experiment_name

    # 1-epoch trials only, so that which trials finish does not depend on the pruner.
    config = research_yaml("killme", space={"learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2,
                                                              "log": True}})
    url = storage_url(_isolated_home)
    log = tmp_path / "run.log"
    proc = start_cli(["research", "run", str(config), "--plain"], log)
    try:
        killed = _wait_for_running_trial(url, "killme", proc, log)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    before = {t.number: t for t in optuna.load_study(study_name="killme", storage=url).get_trials()}
    assert before[killed].state == optuna.trial.TrialState.RUNNING
    finished_before = {n for n, t in before.items() if t.state == optuna.trial.TrialState.COMPLETE}

    result = CliRunner().invoke(app, ["research", "resume", "killme", "--plain"])
    assert result.exit_code == 0, result.output
    assert f"trials [{killed}] were interrupted" in result.output

    study = optuna.load_study(study_name="killme", storage=url)
    trials = {t.number: t for t in study.get_trials()}
    assert trials[killed].state == optuna.trial.TrialState.FAIL
    for n in finished_before:  # kept as they were, not re-run
        assert trials[n].state == optuna.trial.TrialState.COMPLETE and trials[n].value == before[n].value
    retries = [t for t in trials.values() if t.user_attrs.get("retry_of") == killed]
    assert len(retries) == 1 and retries[0].params == before[killed].params
    assert retries[0].state == optuna.trial.TrialState.COMPLETE
    finished = [t for t in trials.values() if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(finished) == 3  # n_trials counts finished trials; the killed one does not count

    mlflow.set_tracking_uri(settings.mlflow_tracking_uri())
    runs = mlflow.search_runs(experiment_names=[experiment_name("killme")], output_format="list")
    parents = [r for r in runs if r.data.tags.get("lorafleet.role") == "parent"]
    nested = [r for r in runs if r.data.tags.get("lorafleet.role") == "trial"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"  # the killed run's parent, reused
    numbers = [int(r.data.tags["lorafleet.trial_number"]) for r in nested]
    assert sorted(numbers) == sorted(trials), "every trial in MLflow exactly once"
    by_number = {int(r.data.tags["lorafleet.trial_number"]): r for r in nested}
    assert by_number[killed].info.status == "FAILED"
    assert by_number[killed].data.tags["lorafleet.trial_state"] == "failed"
    assert "interrupted" in by_number[killed].data.tags["lorafleet.reason"]
    assert by_number[retries[0].number].data.tags["lorafleet.retry_of"] == str(killed)
    assert all(by_number[n].info.status == "FINISHED" for n in trials if n != killed)
    client = mlflow.MlflowClient()
    assert len(client.get_metric_history(parents[0].info.run_id, "base_dev_ndcg_at_10")) == 1
