"""A real study on the tiny model: real Optuna storage, real MLflow store, real training."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_study_logs_parent_and_nested_runs(research_yaml: Callable[..., Path], _isolated_home: Path) -> None:
    import mlflow
    import optuna
    import pandas as pd

    from lorafleet.core import settings
    from lorafleet.core.metrics import mlflow_key
    from lorafleet.core.tasks import get_task_kind
    from lorafleet.research.config import load_config
    from lorafleet.research.runner import run_research
    from lorafleet.research.tracking import experiment_name

    # Random seed 1: after the config's own trial (1 epoch), the sampler draws one 3-epoch and one 1-epoch trial.
    loaded = load_config(research_yaml("study-a", sampler={"kind": "random", "seed": 1}))
    result = run_research(loaded, progress_live=False)

    study = optuna.load_study(study_name="study-a", storage=f"sqlite:///{_isolated_home / 'optuna' / 'optuna.db'}")
    trials = study.get_trials()
    assert len(trials) == 3
    # The threshold pruner can only act at epoch 2: 3-epoch trials are pruned there, 1-epoch trials finish.
    for t in trials:
        expected = optuna.trial.TrialState.PRUNED if t.params["epochs"] == 3 else optuna.trial.TrialState.COMPLETE
        assert t.state == expected, (t.number, t.params, t.state)
    states = {t.state for t in trials}
    assert states == {optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.COMPLETE}  # seed 1 gives a mix
    # The first trial trains the config as written (research.start_from_config, on by default).
    assert trials[0].params == {"epochs": 1, "learning_rate": 1e-3} and trials[0].user_attrs["from_config"]

    mlflow.set_tracking_uri(settings.mlflow_tracking_uri())
    runs = mlflow.search_runs(experiment_names=[experiment_name("study-a")], output_format="list")
    parents = [r for r in runs if r.data.tags.get("lorafleet.role") == "parent"]
    nested = [r for r in runs if r.data.tags.get("lorafleet.role") == "trial"]
    reseeds = [r for r in runs if r.data.tags.get("lorafleet.role") == "reseed"]
    assert len(parents) == 1 and parents[0].info.run_id == result.parent_run_id
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert {r.data.tags["mlflow.parentRunId"] for r in nested + reseeds} == {parent.info.run_id}
    by_number = {int(r.data.tags["lorafleet.trial_number"]): r for r in nested}
    assert sorted(by_number) == [t.number for t in trials]
    client = mlflow.MlflowClient()
    for t in trials:
        run = by_number[t.number]
        state = "pruned" if t.state == optuna.trial.TrialState.PRUNED else "complete"
        assert run.data.tags["lorafleet.trial_state"] == state
        assert run.info.status == "FINISHED"
        assert run.data.params["learning_rate"] == str(t.params["learning_rate"])
        history = client.get_metric_history(run.info.run_id, "dev_ndcg_at_10")
        # One value per epoch, with the epoch as step (plus the final value for complete trials, same step).
        assert {m.step for m in history} == set(range(1, (2 if state == "pruned" else t.params["epochs"]) + 1))
        assert "cost_wall_s" in run.data.metrics and run.data.metrics["cost_wall_s"] > 0
        assert not any(k.startswith("test_") for k in run.data.metrics), "test is read only for the winner"
        if state == "pruned":
            assert "pruned after epoch 2" in run.data.tags["lorafleet.reason"]

    # Baseline once on the parent, for dev and test, base model and BM25.
    for key in ("base_dev_ndcg_at_10", "base_test_ndcg_at_10", "bm25_dev_ndcg_at_10", "bm25_test_ndcg_at_10"):
        assert len(client.get_metric_history(parent.info.run_id, key)) == 1
    # Winner: best complete trial on dev; tested; re-trained with a second seed.
    best = max((t for t in trials if t.state == optuna.trial.TrialState.COMPLETE), key=lambda t: t.value)
    assert result.winner_trial == best.number
    assert result.winner_metrics["dev_ndcg@10"] == pytest.approx(best.value)
    assert "test_ndcg@10" in result.winner_metrics and "test_ndcg@10" in result.reseed_metrics
    assert len(reseeds) == 1 and reseeds[0].info.status == "FINISHED"
    assert result.spread["test_ndcg@10"] == pytest.approx(
        abs(result.winner_metrics["test_ndcg@10"] - result.reseed_metrics["test_ndcg@10"]))
    worst = min(result.winner_metrics["test_ndcg@10"], result.reseed_metrics["test_ndcg@10"])
    expected_candidate = (result.winner_metrics["dev_ndcg@10"] > result.baseline["base_dev_ndcg@10"]
                          and worst > result.baseline["base_test_ndcg@10"])  # margin 0: strictly (a tie is no win)
    assert result.candidate is expected_candidate
    assert parent.data.tags["lorafleet.candidate"] == str(expected_candidate).lower()
    assert parent.data.tags["lorafleet.best_trial"] == str(best.number)
    assert Path(result.winner_adapter_dir, "adapter_config.json").is_file()
    # A complete trial logs its adapter to its run; the winner's is taken from there (any machine can), not
    # from the folder its trial wrote.
    for t in trials:
        logged = {a.path for a in client.list_artifacts(by_number[t.number].info.run_id)}
        assert ("adapter" in logged) is (t.state == optuna.trial.TrialState.COMPLETE), (t.number, logged)
    assert result.winner_adapter_uri == f"runs:/{by_number[best.number].info.run_id}/adapter"
    assert Path(result.winner_adapter_dir).is_relative_to(_isolated_home / "research" / "study-a" / "winner")
    assert (Path(result.winner_adapter_dir, "adapter_model.safetensors").read_bytes()
            == Path(best.user_attrs["adapter_dir"], "adapter_model.safetensors").read_bytes())

    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"optimization_history.png", "param_importances.png", "report.md", "summary.json"} <= artifacts

    # What the MLflow UI shows first (docs/mlflow-ui.md): a model-training experiment with a description and
    # lorafleet's saved view; runs carry only the kind's headline metrics and their dataset; the rest is a table.
    exp = client.get_experiment_by_name(experiment_name("study-a"))
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert "study-a" in exp.tags["mlflow.note.content"] and "mlflow.sharedViewState.lorafleet" in exp.tags
    headline = {mlflow_key(m) for m in get_task_kind("retrieval").metrics.headline_set}
    for run in [parent, *nested, *reseeds]:
        assert set(run.data.metrics) <= headline, (run.info.run_name, set(run.data.metrics) - headline)
        assert [i.dataset.digest for i in run.inputs.dataset_inputs] == [result.dataset_digest[:36]]
    assert {"dev_ndcg_at_10", "test_ndcg_at_10", "base_test_ndcg_at_10", "bm25_test_ndcg_at_10"} <= set(
        parent.data.metrics)
    assert parent.data.metrics["test_ndcg_at_10"] == pytest.approx(result.winner_metrics["test_ndcg@10"])

    def table(run_id: str) -> pd.DataFrame:
        return pd.read_json(client.download_artifacts(run_id, "metrics_table.json"), orient="split")

    assert {"base_test_mrr@10", "bm25_dev_map@100", "trials_complete"} <= set(table(parent.info.run_id)["name"])
    names = table(by_number[best.number].info.run_id)["name"]
    assert "dev_recall@10" in set(names) and not any(names.str.startswith("test_")), "test only for the winner"
    report = Path(result.report_path).read_text()
    assert f"trial #{best.number}" in report and result.verdict in report


# The limit is a repeating SIGALRM; one that lands in a GC callback is swallowed (and reported by pytest)
# before the next one stops the trial. That is the mechanism working, not a leak.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_trial_past_its_time_limit_fails_with_reason(research_yaml: Callable[..., Path], _isolated_home: Path) -> None:
    import mlflow
    import optuna

    from lorafleet.core import settings
    from lorafleet.research.config import load_config
    from lorafleet.research.runner import run_research
    from lorafleet.research.tracking import experiment_name

    loaded = load_config(research_yaml("slow", n_trials=1, trial_timeout_minutes=0.005, reseed=False))
    result = run_research(loaded, progress_live=False)

    (trial,) = optuna.load_study(study_name="slow", storage=f"sqlite:///{_isolated_home / 'optuna' / 'optuna.db'}"
                                 ).get_trials()
    assert trial.state == optuna.trial.TrialState.FAIL
    assert "time limit" in trial.user_attrs["fail_reason"]
    mlflow.set_tracking_uri(settings.mlflow_tracking_uri())
    runs = mlflow.search_runs(experiment_names=[experiment_name("slow")], output_format="list")
    (nested,) = [r for r in runs if r.data.tags.get("lorafleet.role") == "trial"]
    assert nested.info.status == "FAILED" and nested.data.tags["lorafleet.trial_state"] == "failed"
    assert "TrialTimeout" in nested.data.tags["lorafleet.reason"]
    assert result.candidate is False and result.winner_trial is None
    assert "no trial completed" in result.verdict


def test_a_time_limit_wrapped_by_a_library_is_still_named() -> None:
    # The alarm can fire inside MLflow's metric commit, which wraps it: the reason must still say TrialTimeout.
    from lorafleet.research.objective import TrialTimeout, _time_limit_in

    try:
        try:
            raise TrialTimeout("time limit of 0s reached")
        except TrialTimeout as inner:
            raise RuntimeError("MlflowException: time limit of 0s reached") from inner
    except RuntimeError as wrapped:
        assert isinstance(_time_limit_in(wrapped), TrialTimeout)
    assert _time_limit_in(ValueError("other")) is None


def test_the_time_limit_alarm_never_raises_inside_a_finaliser() -> None:
    # Raised in a __del__ the timeout is swallowed (and inside pytest's unraisable hook it breaks the run):
    # the alarm waits for the next tick in ordinary code instead.
    import signal

    from lorafleet.research.objective import TrialTimeout, time_limit

    seen: list[str] = []

    class Finalised:
        def __del__(self) -> None:
            signal.raise_signal(signal.SIGALRM)
            seen.append("finaliser ran to its end")

    with pytest.raises(TrialTimeout), time_limit(60):
        Finalised()
        assert seen == ["finaliser ran to its end"]
        signal.raise_signal(signal.SIGALRM)
