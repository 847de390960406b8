"""Issue 39: a rerank pipeline is judged against its own first stage, through `lorafleet research run
configs/german-legal-rerank.yaml` on a small budget (the packaged MiniLM as cross-encoder, one law, one trial).

The `train:` section's first stage is BM25; the space searches only dense and hybrid first stages, so the winner's
first stage is never the `train:` section's. Dense retrieval beats BM25 by far on this slice (measured: dev nDCG@10
0.65 against 0.58, test 0.73 against 0.25), and a learning rate of 1e-6 leaves the LoRA reranker where the base
reranker is, so the winner is about as good as its own first stage (or the base reranker on it), well above
BM25's. Judged against BM25's baselines (the defect) it was a candidate and was shipped; judged against its own it
is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[2]
STUDY = "rerank-gate"
SMALL = [
    "train.data.laws=[prodhaftg]", "train.data.max_train_queries=12", "train.data.max_eval_queries=12",
    "train.data.max_chunks_per_section=1", "train.data.num_negatives=1", "train.data.negative_range_max=10",
    "train.first_stage.depth=2", "train.epochs=1", "train.learning_rate=1.0e-6", "train.batch_size=16",
    "train.max_seq_length=64", "train.max_pair_length=96", "train.device=cpu",
    f"research.study={STUDY}", "research.n_trials=1", "research.reseed=false", "research.budget_minutes=10",
    "research.sampler={kind: random, seed: 0}", "research.pruner={kind: none}",
    "research.space={first_stage.kind: {type: categorical, choices: [dense, hybrid]}}",
]


def test_rerank_research_ships_only_a_winner_that_beats_its_own_first_stage(_isolated_home: Path) -> None:
    from lorafleet.cli import app
    from lorafleet.registry import store

    args = ["research", "run", str(REPO / "configs" / "german-legal-rerank.yaml"), "--plain", "--tune-quick"]
    out = CliRunner().invoke(app, [*args, *(x for item in SMALL for x in ("--set", item))])
    assert out.exit_code == 0, out.output + repr(out.exception)
    summary = json.loads((_isolated_home / "research" / STUDY / "summary" / "summary.json").read_text())["result"]
    base, winner = summary["baseline"], summary["winner_metrics"]
    kind = summary["winner_config"]["first_stage"]["kind"]
    assert kind in ("dense", "hybrid")
    # The baselines are the winner's own pipeline's: its first stage alone, as its own evaluation measured it.
    assert base["first_test_ndcg@10"] == pytest.approx(winner["first_test_ndcg@10"])
    for split in ("dev", "test"):
        assert base[f"best_{split}_ndcg@10"] >= base[f"first_{split}_ndcg@10"]
        assert base[f"bestfirst_{split}_ndcg@10"] >= base[f"first_{split}_ndcg@10"]
    # Not better than its own first stage by the margin: no candidate, nothing registered.
    assert not (winner["test_ndcg@10"] > base["best_test_ndcg@10"] * 1.02)
    assert summary["candidate"] is False and summary["margin"] == 0.02, summary["verdict"]
    assert "its own first stage alone" in summary["verdict"] and "best first stage alone" in summary["verdict"]
    with pytest.raises(store.RegistryError):
        store.versions(STUDY)
    # The report says what was compared, and how relevance is judged.
    report = (_isolated_home / "research" / STUDY / "summary" / "report.md").read_text()
    assert "| best first stage alone |" in report and "Relevance is binary" in report
