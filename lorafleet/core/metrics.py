"""Metric and parameter names: one builder used by train, research, registry and the CLI.

Metrics are one flat `dict[str, float]`. Names compose by prefix, each layer adding only its own:
an evaluator names `{split}_{metric}` (`test_ndcg@10`, `dev_chrf`), a caller scoring another model
adds `{model}_` (`base_test_ndcg@10`, `bm25_dev_ndcg@10`). MLflow refuses '@' in metric names and
tag keys, so there `@` is spelled `_at_` (`test_ndcg_at_10`); `mlflow_key` is the only place that
does it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

SPLITS = ("train", "dev", "test")


def key(split: str, metric: str) -> str:
    """`{split}_{metric}`: what an evaluator returns for one split."""
    return f"{split}_{metric}"


def prefixed(metrics: Mapping[str, float], prefix: str) -> dict[str, float]:
    """Every key with `{prefix}_` in front (`base_`, `bm25_`, `winner_`); an empty prefix changes nothing."""
    if not prefix:
        return dict(metrics)
    return {f"{prefix}_{k}": v for k, v in metrics.items()}


def to_test(objective: str) -> str:
    """The test metric that matches a dev objective: `dev_ndcg@10` → `test_ndcg@10`."""
    return "test_" + objective.removeprefix("dev_")


def mlflow_key(name: str) -> str:
    """The MLflow-safe spelling of a metric name or tag key ('@' is not allowed there)."""
    return name.replace("@", "_at_")


def from_mlflow_key(name: str) -> str:
    return name.replace("_at_", "@")


def mlflow_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Loggable metrics: MLflow-safe names, numbers only, NaN and infinities left out."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[mlflow_key(prefix + k)] = float(v)
    return out


def flatten_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as flat `a.b.c` keys with string values (MLflow params).

    Lists and dicts inside lists are JSON, so a value reads back unambiguously (`["query", "value"]`).
    """
    out: dict[str, str] = {}

    def walk(path: str, node: Any) -> None:
        if isinstance(node, Mapping) and node:
            for k, v in node.items():
                walk(f"{path}{k}.", v)
        elif isinstance(node, list | tuple | Mapping):
            out[path[:-1]] = json.dumps(node, sort_keys=True, default=str)
        else:
            out[path[:-1]] = str(node)

    walk(f"{prefix}." if prefix else "", tree)
    return out


def ndcg_at_k(ranked: Mapping[str, list[str]], qrels: Mapping[str, Mapping[str, float]], k: int = 10) -> float:
    """Mean nDCG@k over the queries of `qrels`: `ranked[qid]` is the corpus ids best first, `qrels[qid]` the graded
    relevance of the relevant ones (linear gain, log2 discount). A grade ≤ 0 gains nothing, as in ranx, which drops
    judgments below its `rel_lvl` (1 by default; a grade between 0 and 1 still counts here): a document judged -1
    takes a rank, it never makes the score negative. A query with no relevant document is skipped; one missing from
    `ranked` scores 0. Pure, so any stage can score a ranking without another stage's evaluator."""
    scores: list[float] = []
    for qid, rels in qrels.items():
        gains = {doc: float(r) for doc, r in rels.items() if r > 0}
        ideal = sorted(gains.values(), reverse=True)[:k]
        if not ideal:
            continue
        dcg = sum(gains.get(doc, 0.0) / math.log2(i + 2) for i, doc in enumerate(ranked.get(qid, [])[:k]))
        scores.append(dcg / sum(r / math.log2(i + 2) for i, r in enumerate(ideal)))
    return sum(scores) / len(scores) if scores else 0.0
