"""Reciprocal rank fusion (RRF): one ranking from several, by rank alone.

A document's fused score is the sum over the rankings that hold it of `1 / (k + rank)`, rank counted
from 1 (Cormack, Clarke and Büttcher 2009; k = 60 is their constant and everyone's default). Scores
of the input rankings are ignored, which is the point: BM25 scores and cosine similarities live on
different scales, ranks do not. Pure functions, so the hybrid first stage is tested by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

RRF_K = 60

Ranking = dict[str, list[tuple[str, float]]]  # query id → [(doc id, score)] best first (as train.evaluate)


def rrf(rankings: Sequence[Sequence[str]], k: int = RRF_K, depth: int | None = None) -> list[tuple[str, float]]:
    """Fuse doc-id lists (each best first) into [(doc id, fused score)] best first, the top `depth` (None: all).

    Ties (equal fused scores) are broken by doc id, so the result does not depend on the order of the inputs.
    """
    if k < 0:
        raise ValueError(f"RRF constant k must not be negative, got {k}")
    scores: dict[str, float] = {}
    for ranking in rankings:
        for rank, doc in enumerate(ranking, start=1):
            scores[doc] = scores.get(doc, 0.0) + 1.0 / (k + rank)
    fused = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
    return fused if depth is None else fused[:depth]


def fuse_rankings(runs: Sequence[Mapping[str, Sequence[tuple[str, float]]]], k: int = RRF_K,
                  depth: int | None = None) -> Ranking:
    """RRF per query over several runs (query id → [(doc id, score)]); a query missing from a run counts as
    an empty ranking there."""
    queries = sorted({q for run in runs for q in run})
    return {q: rrf([[doc for doc, _ in run.get(q, [])] for run in runs], k, depth) for q in queries}
