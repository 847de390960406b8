"""Your own retrieval data as a RetrievalDataset: the same chunking, splits, leakage check and digest as the statutes.

Layouts (train.config.DatasetData):
* `corpus` — a corpus (id, text[, title]), queries (id, text), qrels (query_id, corpus_id[, score][, split]).
  Rows with score ≤ 0 are not relevant. With a `split` column the data's own splits are kept (train,
  dev/validation, test); without one, documents linked by a shared query form a group and groups
  are split by seed, so no held-out document is a training positive.
* `pairs` — (query, positive[, negative]) rows. The corpus is the distinct positive and negative
  texts; queries are the distinct query texts; a query's positives are its relevant documents; the
  given negatives are used as the training pairs' negatives (instead of mined ones).

A document plays the part of a statute section (`doc:<id>`); it is chunked to the model's length
and scored by its best chunk, as sections are.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from lorafleet.train.kinds.retrieval.config import DatasetData, TrainConfig
from lorafleet.train.kinds.retrieval.dataset import (
    SPLITS,
    Chunk,
    DatasetError,
    Query,
    RetrievalDataset,
    chunk_text,
    compute_digest,
)
from lorafleet.train.kinds.retrieval.dataset import check_no_leakage as check_leakage
from lorafleet.train.statutes import Section
from lorafleet.train.tables import (
    SPLIT_NAMES,
    SplitSettings,
    TableError,
    column,
    load_rows,
    split_groups,
    unique_ids,
)


def _doc(doc_id: str, text: str, title: str = "") -> Section:
    return Section(law="doc", kind="", number=doc_id, title=title, text=text)


def _text_id(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]  # a stable id for a text that came without one


class _Groups:
    """Union-find over document ids: documents relevant to one query must land in one split."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, items: list[str]) -> None:
        for other in items[1:]:
            self.parent[self.find(other)] = self.find(items[0])


def _corpus_layout(d: DatasetData) -> tuple[dict[str, Section], dict[str, str], dict[str, list[str]],
                                              dict[str, str] | None, dict[str, list[str]]]:
    assert d.corpus is not None and d.queries is not None and d.qrels is not None
    c = d.columns
    what = f"corpus {d.corpus.label()}"
    rows = load_rows(d.corpus, "corpus")
    ids = unique_ids(column(rows, "id", c, what, text=False), what, c.get("id", "id"))
    texts = column(rows, "text", c, what)
    titles = column(rows, "title", c, what, required=False, text=False)
    docs = {i: _doc(i, t, str(ti or "")) for i, t, ti in zip(ids, texts, titles, strict=True)}

    what = f"queries {d.queries.label()}"
    rows = load_rows(d.queries, "queries")
    qids = unique_ids(column(rows, "id", c, what, text=False), what, c.get("id", "id"))
    queries = dict(zip(qids, column(rows, "text", c, what), strict=True))

    what = f"qrels {d.qrels.label()}"
    rows = load_rows(d.qrels, "qrels")
    q_col = [str(v) for v in column(rows, "query_id", c, what, text=False)]
    d_col = [str(v) for v in column(rows, "corpus_id", c, what, text=False)]
    scores = column(rows, "score", c, what, required=False, text=False)
    splits = column(rows, "split", c, what, required=False, text=False)
    relevant: dict[str, list[str]] = {}
    split_of_query: dict[str, str] | None = {} if splits[0] is not None else None
    for i, (qid, did, score, split) in enumerate(zip(q_col, d_col, scores, splits, strict=True)):
        if qid not in queries:
            raise TableError(f"{what} row {i}: query {qid!r} is not among the queries")
        if did not in docs:
            raise TableError(f"{what} row {i}: document {did!r} is not in the corpus")
        if score is not None and float(score) <= 0:
            continue
        relevant.setdefault(qid, []).append(did)
        if split_of_query is not None:
            name = SPLIT_NAMES.get(str(split).lower())
            if name is None:
                raise TableError(f"{what} row {i}: split {split!r} is not one of train, dev (validation), test")
            if split_of_query.setdefault(qid, name) != name:
                raise TableError(f"{what} row {i}: query {qid!r} is in two splits")
    return docs, queries, relevant, split_of_query, {}


def _pairs_layout(d: DatasetData) -> tuple[dict[str, Section], dict[str, str], dict[str, list[str]],
                                             dict[str, str] | None, dict[str, list[str]]]:
    assert d.pairs is not None
    c = d.columns
    what = f"pairs {d.pairs.label()}"
    rows = load_rows(d.pairs, "pairs")
    qs, ps = column(rows, "query", c, what), column(rows, "positive", c, what)
    ns = column(rows, "negative", c, what, required=False, text=False)
    docs: dict[str, Section] = {}
    queries: dict[str, str] = {}
    relevant: dict[str, list[str]] = {}
    negatives: dict[str, list[str]] = {}
    for i, (q, p, n) in enumerate(zip(qs, ps, ns, strict=True)):
        if n is not None and not str(n).strip():
            raise TableError(f"{what} row {i}: column {c.get('negative', 'negative')!r} is empty")
        qid, pid = _text_id(q), _text_id(p)
        queries[qid] = q
        docs.setdefault(pid, _doc(pid, p))
        if pid not in relevant.setdefault(qid, []):
            relevant[qid].append(pid)
        if n is not None:
            nid = _text_id(str(n).strip())
            docs.setdefault(nid, _doc(nid, str(n).strip()))
            negatives.setdefault(qid, []).append(str(n).strip())
    return docs, queries, relevant, None, negatives


def build_byo_dataset(cfg: TrainConfig, tokenizer: Any) -> RetrievalDataset:
    """A RetrievalDataset from `cfg.data` (a DatasetData); DatasetError for data that cannot be used."""
    d = cfg.data
    assert isinstance(d, DatasetData)
    try:
        docs, queries, relevant, split_of_query, negatives = (_corpus_layout if d.layout == "corpus"
                                                              else _pairs_layout)(d)
        if not relevant:
            raise TableError("no query has a relevant document")
        if split_of_query is None:
            groups = _Groups()
            for rel in relevant.values():
                groups.union(rel)
            settings = SplitSettings(dev_fraction=d.dev_fraction, test_fraction=d.test_fraction, seed=d.seed)
            group_split = split_groups([groups.find(r[0]) for r in relevant.values()], settings, "the data")
            split_of_query = {qid: group_split[groups.find(rel[0])] for qid, rel in relevant.items()}
    except TableError as exc:
        raise DatasetError(str(exc)) from exc

    sections = {s.id: s for s in docs.values()}
    corpus: dict[str, Chunk] = {}
    for sid, section in sections.items():
        pieces = chunk_text(section.text, tokenizer, cfg.max_seq_length - 2)[: d.max_chunks_per_section]
        for k, piece in enumerate(pieces or [section.text]):
            corpus[f"{sid}#{k}"] = Chunk(f"{sid}#{k}", sid, k, piece)

    caps = {"train": d.max_train_queries, "dev": d.max_eval_queries, "test": d.max_eval_queries}
    out_queries: dict[str, dict[str, str]] = {}
    qrels: dict[str, dict[str, dict[str, int]]] = {}
    info: dict[str, Query] = {}
    split_of_section: dict[str, str] = {}
    for split in SPLITS:
        ids = sorted(q for q in relevant if split_of_query.get(q) == split)
        if caps[split] is not None and len(ids) > caps[split]:
            ids = sorted(random.Random(f"{d.seed}:{split}").sample(ids, caps[split]))
        out_queries[split] = {f"q:{q}": queries[q] for q in ids}
        qrels[split] = {f"q:{q}": {f"doc:{r}": 1 for r in relevant[q]} for q in ids}
        for q in ids:
            info[f"q:{q}"] = Query(f"q:{q}", queries[q], "query", f"doc:{relevant[q][0]}")
            split_of_section.update({f"doc:{r}": split for r in relevant[q]})
    for split in ("train", "test"):
        if not out_queries[split]:
            raise DatasetError(f"the data leaves no {split} queries; add data or change the split fractions")
    dataset = RetrievalDataset(
        sections=sections, corpus=corpus, queries=out_queries, qrels=qrels, query_info=info,
        split_of_section=split_of_section, digest="",
        settings={**d.model_dump(mode="json", exclude={"hard_negatives", "num_negatives", "negative_margin",
                                                       "negative_range_max"}),
                  "max_seq_length": cfg.max_seq_length},
    )
    dataset.given_negatives = {f"q:{q}": negs for q, negs in negatives.items() if f"q:{q}" in out_queries["train"]}
    dataset.digest = compute_digest(dataset)
    try:
        check_leakage(dataset)
    except AssertionError as exc:
        raise DatasetError(f"the data's own splits leak: {exc}; fix the split column or drop it to split by seed") \
            from exc
    return dataset
