"""The rerank pipeline and its evaluation: a first stage finds candidates, the cross-encoder reorders the top k.

First stages (section level, MaxP over chunks, the same machinery as the retrieval kind's evaluation):
`bm25` (train.evaluate.BM25Evaluator), `dense` (an embedder, train.evaluate.DenseEvaluator: a model, or a
registered embedding specialist `models:/NAME/N`, resolved through the core adapter sources) and
`hybrid` (RRF of both, train.fusion). A first stage ranks the top 100 sections; the cross-encoder
scores every chunk of the top `depth` (a section scores its best chunk) and reorders them; places
depth+1…100 keep the first stage's order. So the pipeline's and the first stage's metrics
(train.evaluate.METRICS, per query kind nDCG@10) compare one to one, and `{split}_recall@depth`
(the share of relevant sections among the k candidates) is the ceiling of any reranker there.

Names: the pipeline `{split}_{metric}`, the first stage alone `first_{split}_{metric}` (prefix
FIRST); the base cross-encoder's pipeline `base_…` is the caller's to prefix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lorafleet.core.metrics import prefixed
from lorafleet.train.kinds.rerank.config import FirstStageSettings
from lorafleet.train.kinds.rerank.fusion import fuse_rankings
from lorafleet.train.kinds.retrieval.dataset import RetrievalDataset
from lorafleet.train.kinds.retrieval.evaluate import TOP_K, Ranking, SectionIndex, split_metrics

FIRST = "first"  # metric prefix of the first stage alone
BUNDLE_SPEC = "bundle.yaml"  # beside a registered bundle's adapter folder: names the base it was trained on
FRESH_HEAD_SEED = 0  # the serving runtime's (sidecar ce_runtime.FRESH_HEAD_SEED): a missing head is drawn alike


@dataclass
class RerankDataset:
    """The retrieval dataset (same data, digest and leakage checks) plus first-stage rankings cached per stage
    and split, so that trials on one dataset retrieve once."""

    retrieval: RetrievalDataset
    rankings: dict[tuple[Any, ...], Ranking] = field(default_factory=dict, repr=False)
    _stages: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)

    @property
    def digest(self) -> str:
        return self.retrieval.digest

    @property
    def settings(self) -> dict[str, Any]:
        return self.retrieval.settings

    def summary(self) -> dict[str, int]:
        return self.retrieval.summary()

    def to_frame(self) -> Any:
        return self.retrieval.to_frame()


def load_reranker(source: str, device: str = "cpu", max_length: int | None = None) -> Any:
    """A CrossEncoder with one output; a head the checkpoint lacks is drawn from FRESH_HEAD_SEED, exactly as the
    `cross-encoder` runtime loads its base (so a trained adapter's untouched parts match the served ones)."""
    import torch
    from sentence_transformers.cross_encoder import CrossEncoder
    from transformers.utils import logging as hf_logging

    from lorafleet.core.model_source import resolve_model_source
    from lorafleet.core.progress import quiet_library_bars

    quiet_library_bars()
    hf_logging.set_verbosity_error()  # "newly initialized: classifier" is expected for a BERT checkpoint
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(FRESH_HEAD_SEED)
        model = CrossEncoder(resolve_model_source(source), num_labels=1, device=device, max_length=max_length)
    model.model.eval()
    return model


def stage_key(s: FirstStageSettings, kind: str | None = None) -> tuple[Any, ...]:
    """What makes a first stage's ranking (not its depth, which only decides what the reranker sees)."""
    kind = kind or s.kind
    return (kind, s.embedder if kind in ("dense", "hybrid") else None, s.rrf_k if kind == "hybrid" else None)


def first_stage_ranking(dataset: RerankDataset, s: FirstStageSettings, split: str, device: str = "cpu",
                        batch_size: int = 64) -> Ranking:
    """The first stage's top TOP_K sections for every query of `split` (cached on the dataset)."""
    key = (*stage_key(s), split)
    if key in dataset.rankings:
        return dataset.rankings[key]
    if s.kind == "hybrid":
        runs = [first_stage_ranking(dataset, s.model_copy(update={"kind": k}), split, device, batch_size)
                for k in ("bm25", "dense")]
        ranking = fuse_rankings(runs, k=s.rrf_k, depth=TOP_K)
    else:
        data = dataset.retrieval
        qids = list(data.queries[split])
        texts = [data.queries[split][q] for q in qids]
        stage = _stage(dataset, s, device, batch_size)
        if s.kind == "bm25":
            scores = stage.scores(texts)
        else:
            from lorafleet.train.kinds.retrieval.evaluate import _encode

            model, corpus = stage
            scores = _encode(model, texts, batch_size) @ corpus.T
        ranking = SectionIndex(data).rank(qids, scores, TOP_K)
    dataset.rankings[key] = ranking
    return ranking


def _stage(dataset: RerankDataset, s: FirstStageSettings, device: str, batch_size: int) -> Any:
    """The BM25 index, or (embedder, corpus embeddings): built once per dataset."""
    key = stage_key(s)
    if key not in dataset._stages:
        from lorafleet.train.kinds.retrieval.evaluate import BM25Evaluator, DenseEvaluator

        if s.kind == "bm25":
            dataset._stages[key] = BM25Evaluator(dataset.retrieval)
        else:
            from lorafleet.train.kinds.retrieval.trainer import ProgressEncoder

            model = load_embedder(s.embedder, device, dataset.settings.get("max_seq_length"))
            dense = DenseEvaluator(dataset.retrieval, batch_size)
            dense.encode_corpus(ProgressEncoder(model, "first stage: encode corpus"))
            dataset._stages[key] = (model, dense.corpus_embeddings)
    return dataset._stages[key]


def registered_embedder(uri: str) -> tuple[Path, str]:
    """(adapter folder, base source) of a registered embedding specialist `models:/NAME/N` (or `@alias`).

    Resolved through the core adapter-source contract (the registry's `models:` plugin downloads the bundle and
    checks its digests), so this stage never imports the registry. The base is the one the bundle records beside
    its adapter (`bundle.yaml`, base.source), else the one the adapter recorded when trained."""
    from lorafleet.core.adapters import AdapterUnavailable, recorded_base, resolve_adapter_uri

    adapter_dir = resolve_adapter_uri(uri)
    base: str | None = None
    spec = adapter_dir.parent / BUNDLE_SPEC
    if spec.is_file():
        import yaml

        base = ((yaml.safe_load(spec.read_text()) or {}).get("base") or {}).get("source")
    base = base or recorded_base(adapter_dir)
    if not base:
        raise AdapterUnavailable(f"{uri}: the bundle names no base model to load its adapter on")
    return adapter_dir, str(base)


def load_embedder(embedder: str, device: str = "cpu", max_seq_length: int | None = None) -> Any:
    """The dense first stage's SentenceTransformer: a model (packaged MiniLM, hub id, folder), or a registered
    embedding specialist `models:/NAME/N` (its base with its LoRA active)."""
    from lorafleet.core.refs import MODELS_SCHEME
    from lorafleet.train.kinds.retrieval.trainer import load_adapter_model, load_base_model

    if embedder.startswith(MODELS_SCHEME):
        adapter_dir, base = registered_embedder(embedder)
        return load_adapter_model(base, adapter_dir, device, max_seq_length)
    return load_base_model(embedder, device, max_seq_length)


def section_texts(data: RetrievalDataset) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for chunk in data.corpus.values():
        out.setdefault(chunk.section_id, []).append(chunk.text)
    return out


def rerank(model: Any, queries: dict[str, str], ranking: Ranking, chunks: dict[str, list[str]], depth: int,
           batch_size: int = 64) -> Ranking:
    """Reorder each query's top `depth` sections by the cross-encoder's best chunk score; the rest stay behind in
    the first stage's order (ties keep the first stage's order: the sort is stable)."""
    pairs: list[list[str]] = []
    owners: list[tuple[str, int]] = []  # (query id, candidate position) of each pair
    for qid, ranked in ranking.items():
        for pos, (sid, _) in enumerate(ranked[:depth]):
            for text in chunks[sid]:
                pairs.append([queries[qid], text])
                owners.append((qid, pos))
    scores = (np.asarray(model.predict(pairs, batch_size=batch_size, show_progress_bar=False, convert_to_numpy=True),
                         dtype=np.float64).reshape(-1) if pairs else np.zeros(0))
    best: dict[tuple[str, int], float] = {}
    for owner, score in zip(owners, scores, strict=True):
        best[owner] = max(best.get(owner, -np.inf), float(score))
    out: Ranking = {}
    for qid, ranked in ranking.items():
        head = [(sid, best[(qid, pos)]) for pos, (sid, _) in enumerate(ranked[:depth])]
        out[qid] = sorted(head, key=lambda item: -item[1]) + list(ranked[depth:])
    return out


def candidate_recall(ranking: Ranking, data: RetrievalDataset, split: str, depth: int) -> float:
    """Share of each query's relevant sections among its first `depth` candidates, averaged over queries."""
    qrels = data.qrels[split]
    total = 0.0
    for qid, rel in qrels.items():
        top = {sid for sid, _ in ranking.get(qid, [])[:depth]}
        relevant = {sid for sid, grade in rel.items() if grade > 0}
        total += len(top & relevant) / len(relevant)
    return total / len(qrels)


def pipeline_metrics(model: Any | None, dataset: RerankDataset, s: FirstStageSettings, split: str, *,
                     device: str = "cpu", batch_size: int = 64, first: bool = True) -> dict[str, float]:
    """`{split}_*` of the pipeline with `model` (None: none, only the first stage) and, with `first`, the first
    stage alone as `first_{split}_*`; both with `{split}_recall@depth`."""
    data = dataset.retrieval
    ranking = first_stage_ranking(dataset, s, split, device, batch_size)
    ceiling = {f"{split}_recall@depth": candidate_recall(ranking, data, split, s.depth)}
    out: dict[str, float] = {}
    if first:
        out.update(prefixed({**split_metrics(ranking, data, split), **ceiling}, FIRST))
    if model is not None:
        t0 = time.perf_counter()
        reranked = rerank(model, data.queries[split], ranking, section_texts(data), s.depth, batch_size)
        out.update(split_metrics(reranked, data, split))
        out.update(ceiling)
        out[f"{split}_rerank_s"] = time.perf_counter() - t0
    return out
