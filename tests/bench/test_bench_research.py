"""bench/research.py --quick: the same small study with and without the pruner, on MiniLM."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_research_quick_writes_results(run_quick) -> None:  # type: ignore[no-untyped-def]
    data = run_quick("research", "--trials", "2", timeout=900)  # two trials of real training: minutes on a busy CI box
    assert [a["arm"] for a in data["arms"]] == ["no-pruner", "median-pruner"]
    for arm in data["arms"]:
        assert len(arm["trials"]) == 2 and arm["trials_failed"] == 0, arm
        assert arm["epochs_trained"] >= 2 and arm["trial_wall_s"] > 0
        assert 0.0 <= arm["best_dev_ndcg@10"] <= 1.0
        assert [p["after_trial"] for p in arm["best_vs_budget"]] == [0, 1]
    # Same sampler seed, and the median pruner waits for 2 startup trials: both arms ran the same trials.
    assert [t["params"] for t in data["arms"][0]["trials"]] == [t["params"] for t in data["arms"][1]["trials"]]
    assert data["pruned_vs_unpruned_epochs"] == pytest.approx(1.0)
