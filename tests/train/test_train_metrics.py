"""The metric code against ranx (an independent implementation) on the same rankings."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from lorafleet.train.kinds.retrieval.evaluate import METRICS, SectionIndex, query_metrics, score_rankings


def _random_case(seed: int, n_queries: int = 40, n_docs: int = 150) -> tuple[dict, dict]:
    rng = random.Random(seed)
    docs = [f"d{i}" for i in range(n_docs)]
    qrels, run = {}, {}
    for q in range(n_queries):
        qid = f"q{q}"
        qrels[qid] = {d: 1 for d in rng.sample(docs, rng.randint(1, 4))}
        retrieved = rng.sample(docs, rng.randint(5, 120))
        # Distinct scores, so both implementations see the same order.
        run[qid] = [(d, 1.0 - i / 1000) for i, d in enumerate(retrieved)]
    return qrels, run


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_match_ranx(seed: int) -> None:
    from ranx import Qrels, Run, evaluate

    qrels, run = _random_case(seed)
    ours = score_rankings(run, qrels)
    theirs = evaluate(
        Qrels(qrels), Run({q: dict(r) for q, r in run.items()}), list(METRICS), make_comparable=True
    )
    for name in METRICS:
        assert ours[name] == pytest.approx(theirs[name], abs=1e-9), name


def test_query_metrics_by_hand() -> None:
    m = query_metrics(["a", "b", "c", "d"], {"b": 1, "d": 1, "z": 1})
    assert m["recall@1"] == 0
    assert m["mrr@10"] == 0.5
    assert m["recall@10"] == pytest.approx(2 / 3)
    assert m["map@100"] == pytest.approx((1 / 2 + 2 / 4) / 3)
    idcg = 1 + 1 / math.log2(3) + 1 / math.log2(4)
    assert m["ndcg@10"] == pytest.approx((1 / math.log2(3) + 1 / math.log2(5)) / idcg)


def test_missing_query_scores_zero() -> None:
    out = score_rankings({}, {"q": {"a": 1}})
    assert all(v == 0 for v in out.values())


def test_section_index_takes_best_chunk() -> None:
    from types import SimpleNamespace

    ids = ["s1#0", "s1#1", "s2#0", "s3#0", "s3#1", "s3#2"]
    fake = SimpleNamespace(corpus={c: SimpleNamespace(section_id=c.split("#")[0]) for c in ids}, chunk_ids=ids)
    index = SectionIndex(fake)  # type: ignore[arg-type]
    scores = np.array([[0.1, 0.9, 0.5, 0.2, 0.3, 0.95]], dtype=np.float32)
    ranking = index.rank(["q"], scores)
    assert [s for s, _ in ranking["q"]] == ["s3", "s1", "s2"]
    assert [round(v, 2) for _, v in ranking["q"]] == [0.95, 0.9, 0.5]
