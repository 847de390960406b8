"""`lorafleet.core.metrics.ndcg_at_k` with graded and negative judgments, against ranx (an independent implementation):
a grade ≤ 0 gains nothing, so the score stays in [0, 1]."""

from __future__ import annotations

import math
import random

import pytest

from lorafleet.core.metrics import ndcg_at_k


def _ranx_ndcg(ranked: dict[str, list[str]], qrels: dict[str, dict[str, int]], k: int) -> float:
    from ranx import Qrels, Run, evaluate

    run = {q: {d: 1.0 - i / 1000 for i, d in enumerate(docs)} for q, docs in ranked.items()}
    return float(evaluate(Qrels(qrels), Run(run), f"ndcg@{k}", make_comparable=True))


def test_a_negative_grade_costs_a_rank_not_the_score() -> None:
    """The issue's figure: the relevant document second behind one judged -1 scored -0.369; ranx gives 0.631."""
    ranked, qrels = {"q": ["bad", "good"]}, {"q": {"good": 1, "bad": -1}}
    assert ndcg_at_k(ranked, qrels) == pytest.approx(1 / math.log2(3))  # 0.631
    assert ndcg_at_k(ranked, qrels) == pytest.approx(_ranx_ndcg(ranked, qrels, 10), abs=1e-12)
    assert ndcg_at_k({"q": ["good", "bad"]}, qrels) == 1.0


@pytest.mark.parametrize("seed", [0, 1])
def test_graded_and_negative_judgments_match_ranx(seed: int) -> None:
    rng = random.Random(seed)
    docs = [f"d{i}" for i in range(60)]
    qrels = {f"q{q}": {d: rng.choice([-2, -1, 0, 1, 2, 3]) for d in rng.sample(docs, rng.randint(2, 8))}
             for q in range(30)}
    qrels = {q: rels for q, rels in qrels.items() if any(r > 0 for r in rels.values())}  # ranx scores the rest 0
    ranked = {q: rng.sample(docs, rng.randint(3, 40)) for q in qrels}
    for k in (5, 10):
        ours = ndcg_at_k(ranked, qrels, k)
        assert 0.0 <= ours <= 1.0
        assert ours == pytest.approx(_ranx_ndcg(ranked, qrels, k), abs=1e-9)
