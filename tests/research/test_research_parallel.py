"""Two processes drive one study at once (the local stand-in for several machines on PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from research_testkit import start_cli, storage_url

from lorafleet.testing import wait_all

pytestmark = pytest.mark.integration


def test_two_processes_share_one_study(research_yaml: Callable[..., Path], _isolated_home: Path,
                                       tmp_path: Path) -> None:
    import mlflow
    import optuna

    from lorafleet.core import settings
    from lorafleet.research.tracking import experiment_name

    config = research_yaml("shared", n_trials=4,
                           space={"learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}})
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [start_cli(["research", "run", str(config), "--plain"], log) for log in logs]
    codes = wait_all(procs, timeout=300)
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n----\n".join(o[-3000:] for o in outputs)

    trials = optuna.load_study(study_name="shared", storage=storage_url(_isolated_home)).get_trials()
    numbers = [t.number for t in trials]
    assert len(numbers) == len(set(numbers))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert 4 <= len(trials) <= 5  # two processes may each start the last trial at the same moment
    workers = {t.user_attrs["worker"] for t in trials}
    assert len(workers) == 2, "both processes ran trials"

    mlflow.set_tracking_uri(settings.mlflow_tracking_uri())
    runs = mlflow.search_runs(experiment_names=[experiment_name("shared")], output_format="list")
    parents = [r for r in runs if r.data.tags.get("lorafleet.role") == "parent"]
    nested = [r for r in runs if r.data.tags.get("lorafleet.role") == "trial"]
    reseeds = [r for r in runs if r.data.tags.get("lorafleet.role") == "reseed"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert sorted(int(r.data.tags["lorafleet.trial_number"]) for r in nested) == sorted(numbers)
    assert all(r.info.status == "FINISHED" and r.data.tags["lorafleet.trial_state"] == "complete" for r in nested)
    assert len(reseeds) == 1, "one process writes the summary"
    assert sum("baseline vs winner" in o for o in outputs) == 1
