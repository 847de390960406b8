"""Honest evaluation: dev selects, test is looked at once per study, for the winner.

A counting task kind (the real retrieval kind on the tiny model) records every time an adapter or the base
model is scored on test, and in which phase (baselines, a trial's training, the kind's `evaluate`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ONE_EPOCH_SPACE = {"learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}}


def _counting_kind(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The retrieval kind, recording (phase, split) of every split scored and every `evaluate` call."""
    import lorafleet.train.kinds.retrieval.evaluate as evaluate_module
    from lorafleet.train.kinds.retrieval.kind import RetrievalKind

    class CountingKind(RetrievalKind):
        def __init__(self) -> None:
            self.phase = "other"
            self.scored: list[tuple[str, str]] = []
            self.evaluated: list[tuple[Path, str]] = []
            self.trained: list[Path] = []
            self.dev_bonus = 0.0  # added to the objective a trial reports: makes a later trial lead on dev

        def _in(self, phase: str, call: Callable[[], Any]) -> Any:
            before, self.phase = self.phase, phase
            try:
                return call()
            finally:
                self.phase = before

        def baselines(self, cfg: Any, dataset: Any) -> dict[str, float]:
            return self._in("baselines", lambda: super(CountingKind, self).baselines(cfg, dataset))

        def train(self, cfg: Any, dataset: Any, out_dir: Path, *, on_epoch: Any = None) -> Any:
            result = self._in("train", lambda: super(CountingKind, self).train(cfg, dataset, out_dir,
                                                                                on_epoch=on_epoch))
            self.trained.append(Path(result.adapter_dir))
            result.metrics["dev_ndcg@10"] += self.dev_bonus
            return result

        def evaluate(self, cfg: Any, dataset: Any, adapter_dir: Path, split: str) -> dict[str, float]:
            self.evaluated.append((Path(adapter_dir), split))
            return self._in("evaluate", lambda: super(CountingKind, self).evaluate(cfg, dataset, adapter_dir, split))

        def test_scorings(self, phase: str | None = None) -> list[str]:
            return [p for p, split in self.scored if split == "test" and phase in (None, p)]

    kind = CountingKind()
    real = evaluate_module.split_metrics

    def split_metrics(ranking: Any, dataset: Any, split: str) -> dict[str, float]:
        kind.scored.append((kind.phase, split))
        return real(ranking, dataset, split)

    monkeypatch.setattr(evaluate_module, "split_metrics", split_metrics)
    return kind


def _study(home: Path, name: str) -> Any:
    import optuna

    return optuna.load_study(study_name=name, storage=f"sqlite:///{home / 'optuna' / 'optuna.db'}")


def _parent_tags(run_id: str) -> dict[str, str]:
    import mlflow

    from lorafleet.core import settings

    mlflow.set_tracking_uri(settings.mlflow_tracking_uri())
    return dict(mlflow.MlflowClient().get_run(run_id).data.tags)


def test_test_split_is_scored_once_for_the_winner(research_yaml: Callable[..., Path], _isolated_home: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafleet.research.config import load_config
    from lorafleet.research.runner import run_research

    kind = _counting_kind(monkeypatch)
    loaded = load_config(research_yaml("once", reseed=False, space=ONE_EPOCH_SPACE))
    result = run_research(loaded, kind=kind, progress_live=False)

    assert len(kind.trained) == 3 and result.winner_trial is not None
    assert kind.test_scorings("train") == [], "a trial's training scored the test split"
    assert kind.test_scorings("evaluate") == ["evaluate"]
    assert [split for _, split in kind.evaluated] == ["test"], kind.evaluated
    assert kind.evaluated[0][0].name == "adapter"
    assert "test_ndcg@10" in result.winner_metrics
    assert not list((_isolated_home / "research").rglob("test_metrics.json")), "no per-trial test stash"

    # The record of that one look: keyed by the study's id and the dataset's digest, not name and trial number.
    from lorafleet.research.study import study_uid, tested_key

    study = _study(_isolated_home, "once")
    uid = study_uid(study)
    key = tested_key(uid, result.dataset_digest or "")
    assert uid and result.dataset_digest and uid in key and result.dataset_digest in key
    record = study.user_attrs[key]
    assert record["trial"] == result.winner_trial
    assert record["metrics"]["test_ndcg@10"] == pytest.approx(result.winner_metrics["test_ndcg@10"])
    tag = _parent_tags(result.parent_run_id)["lorafleet.test_evaluated"]
    assert uid in tag and result.dataset_digest in tag and f"trial #{result.winner_trial}" in tag


def test_resume_after_no_candidate_does_not_look_at_test_again(
        research_yaml: Callable[..., Path], _isolated_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafleet.research.config import load_config
    from lorafleet.research.runner import run_research

    # A margin of 1000 %: the winner cannot be a candidate.
    loaded = load_config(research_yaml("nocand", n_trials=2, min_margin=10.0, space=ONE_EPOCH_SPACE))
    first_kind = _counting_kind(monkeypatch)
    first = run_research(loaded, kind=first_kind, progress_live=False)
    assert first.verdict.startswith("no candidate") and not first.candidate
    # The winner and its second seed, once each; no trial's training.
    assert [split for _, split in first_kind.evaluated] == ["test", "test"]
    assert first_kind.test_scorings("train") == []

    # More trials on resume, and the new one leads on dev: the study's test split was already looked at, so it
    # is not tested (that would be choosing among test results), and the tested winner and its verdict stand.
    again = _counting_kind(monkeypatch)
    again.dev_bonus = 1.0
    second = run_research(loaded, n_trials=3, resume=True, kind=again, progress_live=False)
    assert len(again.trained) == 1, "the resumed study ran its third trial"
    assert _study(_isolated_home, "nocand").best_trial.number == 2
    assert again.test_scorings() == [], f"resume scored test again: {again.scored}"
    assert again.evaluated == []
    assert not second.candidate and second.verdict.startswith("no candidate")
    assert second.winner_trial == first.winner_trial
    assert second.winner_metrics["test_ndcg@10"] == first.winner_metrics["test_ndcg@10"]
    assert second.reseed_metrics == first.reseed_metrics
    assert f"trial #2 now leads on dev, but this study's test split was already used, for trial " \
           f"#{first.winner_trial}" in second.verdict


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[Any]:
    import optuna

    from lorafleet.research.config import ResearchConfig

    cfg = ResearchConfig.model_validate({"study": "x", "space": ONE_EPOCH_SPACE})
    yield optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'o.db'}"), cfg


def test_a_study_made_again_under_the_same_name_has_another_id(storage: Any) -> None:
    import optuna

    from lorafleet.research.study import open_study, study_uid, tested_key

    store, cfg = storage
    first, created = open_study("same", store, cfg, {"task": "retrieval"})
    assert created
    uid = study_uid(first)
    first.set_user_attr(tested_key(uid, "d1"), {"trial": 0})
    optuna.delete_study(study_name="same", storage=store)
    second, created = open_study("same", store, cfg, {"task": "retrieval"})
    assert created and study_uid(second) != uid
    assert not any(k.startswith("test:") for k in second.user_attrs), "a record of the old study leaked"
    assert tested_key(uid, "d1") != tested_key(uid, "d2")


@pytest.mark.parametrize("older_summary", [False, True])
def test_resume_of_a_summarised_study_hands_back_the_whole_winner(
        research_yaml: Callable[..., Path], _isolated_home: Path, monkeypatch: pytest.MonkeyPatch,
        older_summary: bool) -> None:
    """Shipping can fail after the summary (a tuning error); `research resume NAME` then ships the same winner, so
    it must get the winner's config, metrics and data digest back, not only its verdict, and look at nothing.
    A summary written by an older version (verdict only) is written again, reusing the study's one test look."""
    from lorafleet.research.config import load_config
    from lorafleet.research.runner import run_research
    from lorafleet.research.study import ATTR_FINALIZED

    loaded = load_config(research_yaml("reship", n_trials=1, space=ONE_EPOCH_SPACE, reseed=False))
    first = run_research(loaded, kind=_counting_kind(monkeypatch), progress_live=False)
    assert first.finalized and first.winner_config and first.winner_metrics
    if older_summary:
        study = _study(_isolated_home, "reship")
        done = study.user_attrs[ATTR_FINALIZED]
        study.set_user_attr(ATTR_FINALIZED, {k: done[k] for k in (
            "trials", "at", "candidate", "verdict", "winner_trial", "winner_adapter_dir", "winner_adapter_uri")})
    again = _counting_kind(monkeypatch)
    second = run_research(loaded, resume=True, kind=again, progress_live=False)
    assert again.trained == [] and again.evaluated == [] and again.test_scorings() == []
    for key in ("candidate", "verdict", "winner_trial", "winner_params", "winner_config", "winner_adapter_dir",
                "winner_metrics", "reseed_metrics", "dataset_digest"):
        assert getattr(second, key) == getattr(first, key), key
    assert second.report_path and Path(second.report_path).is_file()
    assert "winner_config" in _study(_isolated_home, "reship").user_attrs[ATTR_FINALIZED]
