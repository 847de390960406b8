"""Retrieval evaluation at section level: dense (a SentenceTransformer) and BM25 (bm25s), same metrics.

Every chunk is scored; a section's score is the best of its chunks (MaxP). Metrics use binary
relevance: nDCG@10, MRR@10, recall@1/10/100, MAP@100 (average precision over the top 100,
divided by the number of relevant sections, as trec_eval and ranx do). Names are
`{split}_{metric}`, e.g. `dev_ndcg@10`, plus nDCG@10 per query kind (`dev_heading_ndcg@10`,
`dev_citation_ndcg@10`); callers add `base_` / `bm25_` prefixes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from lorafleet.train.kinds.retrieval.dataset import RetrievalDataset

METRICS = ("ndcg@10", "mrr@10", "recall@1", "recall@10", "recall@100", "map@100")
TOP_K = 100

Ranking = dict[str, list[tuple[str, float]]]  # query id → [(section id, score)] best first


def query_metrics(ranked: list[str], relevant: Mapping[str, int]) -> dict[str, float]:
    """Metrics of one query; `ranked` is section ids best first, `relevant` their judged relevance (> 0)."""
    rel = {doc for doc, grade in relevant.items() if grade > 0}
    if not rel:
        raise ValueError("a query without relevant documents cannot be scored")
    hits = [doc in rel for doc in ranked[:TOP_K]]
    dcg = sum(1.0 / math.log2(i + 2) for i, h in enumerate(hits[:10]) if h)
    idcg = sum(1.0 / math.log2(i + 2) for i in range(min(len(rel), 10)))
    first = next((i for i, h in enumerate(hits[:10]) if h), None)
    precisions, found = [], 0
    for i, h in enumerate(hits):
        if h:
            found += 1
            precisions.append(found / (i + 1))
    return {
        "ndcg@10": dcg / idcg,
        "mrr@10": 0.0 if first is None else 1.0 / (first + 1),
        "recall@1": sum(hits[:1]) / len(rel),
        "recall@10": sum(hits[:10]) / len(rel),
        "recall@100": sum(hits[:100]) / len(rel),
        "map@100": sum(precisions) / len(rel),
    }


def score_rankings(ranking: Ranking, qrels: Mapping[str, Mapping[str, int]]) -> dict[str, float]:
    """Mean of `query_metrics` over every judged query (a query missing from `ranking` scores 0)."""
    if not qrels:
        raise ValueError("no judged queries to score")
    totals = dict.fromkeys(METRICS, 0.0)
    for qid, relevant in qrels.items():
        per = query_metrics([doc for doc, _ in ranking.get(qid, [])], relevant)
        for name in METRICS:
            totals[name] += per[name]
    return {name: totals[name] / len(qrels) for name in METRICS}


def split_metrics(ranking: Ranking, dataset: RetrievalDataset, split: str) -> dict[str, float]:
    """`{split}_{metric}` over all queries of `split`, plus `{split}_{kind}_ndcg@10` per query kind."""
    qrels = dataset.qrels[split]
    out = {f"{split}_{k}": v for k, v in score_rankings(ranking, qrels).items()}
    kinds = sorted({dataset.query_info[q].kind for q in qrels})
    for kind in kinds:
        subset = {q: rel for q, rel in qrels.items() if dataset.query_info[q].kind == kind}
        out[f"{split}_{kind}_ndcg@10"] = score_rankings(ranking, subset)["ndcg@10"]
    return out


class SectionIndex:
    """Maps chunk scores to section scores (max over each section's chunks) and ranks them."""

    def __init__(self, dataset: RetrievalDataset) -> None:
        self.chunk_ids = dataset.chunk_ids
        sections: list[str] = []
        starts: list[int] = []
        for i, cid in enumerate(self.chunk_ids):
            sid = dataset.corpus[cid].section_id
            if not sections or sections[-1] != sid:
                sections.append(sid)
                starts.append(i)
        if len(set(sections)) != len(sections):
            raise ValueError("a section's chunks must be contiguous in the corpus")
        self.section_ids = sections
        self._starts = np.asarray(starts)

    def rank(self, query_ids: list[str], chunk_scores: np.ndarray, k: int = TOP_K) -> Ranking:
        section_scores = np.maximum.reduceat(chunk_scores, self._starts, axis=1)
        k = min(k, section_scores.shape[1])
        out: Ranking = {}
        for row, qid in zip(section_scores, query_ids, strict=True):
            top = np.argpartition(-row, k - 1)[:k]
            # Ties broken by section order, so rankings are deterministic.
            top = top[np.lexsort((top, -row[top]))]
            out[qid] = [(self.section_ids[j], float(row[j])) for j in top]
        return out


def _encode(model: Any, texts: list[str], batch_size: int) -> np.ndarray:
    return model.encode(
        texts, batch_size=batch_size, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False
    ).astype(np.float32)


class DenseEvaluator:
    """Encodes the corpus once per model state and scores any split against it."""

    def __init__(self, dataset: RetrievalDataset, batch_size: int = 32) -> None:
        self.dataset = dataset
        self.index = SectionIndex(dataset)
        self.batch_size = batch_size
        self.corpus_embeddings: np.ndarray | None = None

    def encode_corpus(self, model: Any) -> np.ndarray:
        texts = [self.dataset.corpus[c].text for c in self.index.chunk_ids]
        self.corpus_embeddings = _encode(model, texts, self.batch_size)
        return self.corpus_embeddings

    def evaluate(self, model: Any, splits: Iterable[str], *, reuse_corpus: bool = False) -> dict[str, float]:
        if self.corpus_embeddings is None or not reuse_corpus:
            self.encode_corpus(model)
        assert self.corpus_embeddings is not None
        out: dict[str, float] = {}
        for split in splits:
            qids = list(self.dataset.queries[split])
            q = _encode(model, [self.dataset.queries[split][i] for i in qids], self.batch_size)
            out.update(split_metrics(self.index.rank(qids, q @ self.corpus_embeddings.T), self.dataset, split))
        return out


def evaluate_model(model: Any, dataset: RetrievalDataset, split: str, batch_size: int = 32) -> dict[str, float]:
    """Metrics of a loaded SentenceTransformer on `split`, named `{split}_{metric}` (no prefix)."""
    _check_split(dataset, split)
    return DenseEvaluator(dataset, batch_size).evaluate(model, [split])


class BM25Evaluator:
    """BM25 (bm25s, German stop words, lower-cased, no stemming) over the same chunks, MaxP to sections."""

    def __init__(self, dataset: RetrievalDataset) -> None:
        import bm25s

        self.dataset = dataset
        self.index = SectionIndex(dataset)
        texts = [dataset.corpus[c].text for c in self.index.chunk_ids]
        self.retriever = bm25s.BM25()
        self.retriever.index(bm25s.tokenize(texts, stopwords="de", show_progress=False), show_progress=False)
        self._bm25s = bm25s

    def scores(self, texts: list[str]) -> np.ndarray:
        tokens = self._bm25s.tokenize(texts, stopwords="de", return_ids=False, show_progress=False)
        vocab = self.retriever.vocab_dict
        rows = np.zeros((len(texts), len(self.index.chunk_ids)), dtype=np.float32)
        for i, toks in enumerate(tokens):
            known = [t for t in toks if t in vocab]
            if known:
                rows[i] = self.retriever.get_scores(known)
        return rows

    def evaluate(self, splits: Iterable[str]) -> dict[str, float]:
        out: dict[str, float] = {}
        for split in splits:
            qids = list(self.dataset.queries[split])
            ranking = self.index.rank(qids, self.scores([self.dataset.queries[split][i] for i in qids]))
            out.update(split_metrics(ranking, self.dataset, split))
        return out


def evaluate_bm25(dataset: RetrievalDataset, split: str) -> dict[str, float]:
    """BM25 metrics on `split`, named `{split}_{metric}` (no prefix)."""
    _check_split(dataset, split)
    return BM25Evaluator(dataset).evaluate([split])


def _check_split(dataset: RetrievalDataset, split: str) -> None:
    if split not in dataset.queries:
        raise ValueError(f"unknown split {split!r}; use one of {sorted(dataset.queries)}")
    if not dataset.queries[split]:
        raise ValueError(f"split {split!r} has no queries")
