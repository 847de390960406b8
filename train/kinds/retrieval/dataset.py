"""The retrieval dataset: corpus chunks, queries of two kinds, seeded splits, a content digest.

Decisions (documented here because every metric depends on them):

* **Corpus unit = chunk, relevance unit = section.** A section's text (without its heading, so
  that the heading query is not a string match) is cut into chunks of at most
  `max_seq_length - 2` model tokens, preferring sentence ends, never inside a word. Chunk ids are `<section id>#<k>`
  (`kschg:§1#0`, `kschg:§1#1`, …); `Chunk.section_id` maps a chunk back to its section.
  Retrieval scores every chunk and gives a section the best score of its chunks (max-pooling,
  "MaxP"), so rankings, qrels and metrics are at section level. Training pairs a query with the
  first chunk of its section.
* **Queries.** `heading`: a section's heading → that section (headings shared by two sections of
  the chosen laws are ambiguous and dropped). `citation`: a sentence of another section of the
  same law that cites exactly one `§ N` / `Art. N` of that law, with the citation (and its
  Abs./Satz/Nr. qualifiers) removed → § N. Every query has exactly one relevant section.
* **Splits by section.** Sections that are the answer to some query are shuffled with
  `data.seed` and cut into train/dev/test; a query goes to the split of its relevant section.
  So no dev or test section is ever a training positive (checked by `check_no_leakage`). Hard
  negatives are mined among training sections only.
* **Digest** = sha256 over the canonical JSON of what a model sees and is scored on (chunks,
  queries, qrels per split) plus the data settings and `max_seq_length` (the
  tokenizer's effect is in the chunk texts). Hard negatives are mined at training time and logged as parameters.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.core.settings import DataDirError, data_dir
from lorafleet.train.chunks import DatasetError, chunk_text
from lorafleet.train.kinds.retrieval.config import DatasetData, TrainConfig
from lorafleet.train.statute_source import source_id
from lorafleet.train.statutes import Law, Section, law_path, parse_law

SPLITS = ("train", "dev", "test")


@dataclass(frozen=True)
class Chunk:
    id: str
    section_id: str
    index: int
    text: str


@dataclass(frozen=True)
class Query:
    id: str
    text: str
    kind: str
    section_id: str  # the one relevant section
    source_id: str | None = None  # citation queries: the section the sentence comes from


@dataclass
class RetrievalDataset:
    """Corpus (chunk id → chunk), sections, queries and qrels per split, and the content digest."""

    sections: dict[str, Section]
    corpus: dict[str, Chunk]
    queries: dict[str, dict[str, str]]  # split → query id → text
    qrels: dict[str, dict[str, dict[str, int]]]  # split → query id → {section id: 1}
    query_info: dict[str, Query]
    split_of_section: dict[str, str]
    digest: str
    settings: dict[str, Any] = field(default_factory=dict)
    # Negatives that came with the data (bring-your-own pairs): training query id → negative texts.
    given_negatives: dict[str, list[str]] = field(default_factory=dict)
    # Mined hard negatives, keyed by the mining settings, so that many trials on one dataset mine once.
    negatives_cache: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)

    @property
    def chunk_ids(self) -> list[str]:
        return list(self.corpus)

    def first_chunk(self, section_id: str) -> Chunk:
        return self.corpus[f"{section_id}#0"]

    def train_pairs(self) -> list[tuple[str, str]]:
        """(query text, first chunk of its relevant section) for every training query, in id order."""
        train = self.queries["train"]
        return [(text, self.first_chunk(self.query_info[qid].section_id).text) for qid, text in train.items()]

    def summary(self) -> dict[str, int]:
        out = {"sections": len(self.sections), "chunks": len(self.corpus)}
        for split in SPLITS:
            out[f"{split}_queries"] = len(self.queries[split])
            kinds = Counter(self.query_info[q].kind for q in self.queries[split])
            for kind, n in sorted(kinds.items()):
                out[f"{split}_{kind}_queries"] = n
        return out

    def to_frame(self) -> Any:
        """One row per (split, query, relevant section): what MLflow records as the dataset input."""
        import pandas as pd

        rows = [
            {"split": split, "query_id": qid, "kind": self.query_info[qid].kind, "query": text,
             "section_id": self.query_info[qid].section_id}
            for split in SPLITS for qid, text in self.queries[split].items()
        ]
        return pd.DataFrame(rows)


# ---------------------------------------------------------------- queries

# One citation of the same law: "§ 433", "§ 31a Abs. 2 Satz 1", "Artikel 20 Absatz 4", optionally
# "dieses Gesetzes". Qualifiers are removed together with the citation.
_QUAL = r"(?:\s+(?:Abs\.|Absatz|S\.|Satz|Nr\.|Nummer|Halbsatz|Buchstabe|Buchst\.)\s+\d*[a-z]?)*"
_CITE = re.compile(r"(?<!§)(§|Art\.|Artikel)\s+(\d+[a-z]?)\b" + _QUAL + r"(?:\s+dieses\s+Gesetzes)?")
_ANY_CITE = re.compile(r"§|\bArt\.\s*\d|\bArtikel\s+\d")
# Looked for in the words after a citation (up to the next comma/semicolon): a sign that it names
# another law ("des Bürgerlichen Gesetzbuchs", "der Zivilprozessordnung", "BGB", "Nr. 11 oder 12 des …").
_OTHER_LAW = re.compile(
    r"^\s*(?:des|der)\s|\b(?:des|der)\s+(?:[A-ZÄÖÜ]\w*\s+)*[A-ZÄÖÜ]\w*(?:gesetz|gesetzes|gesetzbuch|gesetzbuchs|buch|buchs|"
    r"buches|ordnung|verordnung|richtlinie|vertrag|vertrages|übereinkommens)\b|\b[A-Z][A-Za-z]*[A-Z]\b|"
    r"\bSozialgesetzbuch|\bBuch(?:es)?\b"
)
_SENTENCE_SPLIT = re.compile(r"(?<=[.;])\s+(?=[(§A-ZÄÖÜ])|\s(?=\(\d+[a-z]?\)\s)")
_PARAGRAPH_MARK = re.compile(r"^\(\d+[a-z]?\)\s*")


def _sentences(text: str) -> list[str]:
    return [_PARAGRAPH_MARK.sub("", s).strip() for s in _SENTENCE_SPLIT.split(text)]


def citation_queries(law: Law, min_words: int, max_words: int) -> list[tuple[str, str, str]]:
    """(query text, cited section id, citing section id) for sentences that cite one section of `law`."""
    by_label = {(s.kind.rstrip("."), s.number): s for s in law.sections}
    out: list[tuple[str, str, str]] = []
    seen: set[str] = set()
    for source in law.sections:
        for sentence in _sentences(source.text):
            if len(_ANY_CITE.findall(sentence)) != 1:
                continue
            m = _CITE.search(sentence)
            if m is None or _OTHER_LAW.search(re.split(r"[,;]", sentence[m.end() :], maxsplit=1)[0][:80]):
                continue
            kind = "§" if m.group(1) == "§" else "Art"
            target = by_label.get((kind, m.group(2)))
            if target is None or target.id == source.id:
                continue
            words = (sentence[: m.start()] + " " + sentence[m.end() :]).split()
            if len(words) < min_words:
                continue
            query = " ".join(words[:max_words])
            if query in seen:
                continue
            seen.add(query)
            out.append((query, target.id, source.id))
    return out


# ---------------------------------------------------------------- building


def _load_tokenizer(base_model: str) -> Any:
    from transformers import AutoTokenizer

    from lorafleet.core.model_source import resolve_model_source

    return AutoTokenizer.from_pretrained(resolve_model_source(base_model))


def _seeded_sample(ids: list[str], cap: int | None, seed: int, salt: str) -> list[str]:
    if cap is None or len(ids) <= cap:
        return ids
    rng = random.Random(f"{seed}:{salt}")
    return sorted(rng.sample(ids, cap))


def build_dataset(cfg: TrainConfig, *, data_root: Path | None = None, tokenizer: Any = None) -> RetrievalDataset:
    """Parse the chosen laws (or read your own tables), chunk them, build queries, split them, hash the result."""
    from lorafleet.train.kinds.retrieval.byo import build_byo_dataset

    d = cfg.data
    if isinstance(d, DatasetData):
        return build_byo_dataset(cfg, tokenizer if tokenizer is not None else _load_tokenizer(cfg.base_model))
    root = Path(data_root) if data_root is not None else data_dir()
    laws = [parse_law(root, stem) for stem in d.laws]
    sections: dict[str, Section] = {s.id: s for law in laws for s in law.sections}
    if not sections:
        raise DatasetError(f"the laws {d.laws} hold no sections (empty corpus); check the files under {root}/gesetze")

    tok = tokenizer if tokenizer is not None else _load_tokenizer(cfg.base_model)
    corpus: dict[str, Chunk] = {}
    for sid, section in sections.items():
        pieces = chunk_text(section.text, tok, cfg.max_seq_length - 2)[: d.max_chunks_per_section]
        for k, piece in enumerate(pieces):
            corpus[f"{sid}#{k}"] = Chunk(f"{sid}#{k}", sid, k, piece)

    candidates: list[Query] = []
    if "heading" in d.query_kinds:
        counts = Counter(s.title.casefold() for s in sections.values() if s.title)
        for sid, s in sections.items():
            if s.title and counts[s.title.casefold()] == 1:
                candidates.append(Query(f"heading:{sid}", s.title, "heading", sid))
    if "citation" in d.query_kinds:
        per_target: Counter[str] = Counter()
        for law in laws:
            for i, (text, target, source) in enumerate(citation_queries(law, d.min_query_words, d.max_query_words)):
                if per_target[target] >= d.max_citations_per_section:
                    continue
                per_target[target] += 1
                candidates.append(Query(f"citation:{target}:{i}", text, "citation", target, source))
    if not candidates:
        raise DatasetError(f"no queries of kinds {d.query_kinds} could be built from {d.laws}")

    # Sections with identical text (statutes repeat themselves) form one group that stays in one split.
    groups: dict[str, list[str]] = {}
    for sid in sorted({q.section_id for q in candidates}):
        groups.setdefault(sections[sid].text, []).append(sid)
    ordered = sorted(groups.values())
    random.Random(d.seed).shuffle(ordered)
    n_test = round(len(ordered) * d.test_fraction)
    n_dev = round(len(ordered) * d.dev_fraction)
    if n_test == 0:
        raise DatasetError(
            f"test_fraction={d.test_fraction} of {len(ordered)} answerable sections leaves no test queries; "
            "raise test_fraction or add laws"
        )
    split_of_section: dict[str, str] = {}
    for i, group in enumerate(ordered):
        split = "test" if i < n_test else "dev" if i < n_test + n_dev else "train"
        split_of_section.update({sid: split for sid in group})

    by_split: dict[str, list[Query]] = {s: [] for s in SPLITS}
    for q in candidates:
        by_split[split_of_section[q.section_id]].append(q)
    caps = {"train": d.max_train_queries, "dev": d.max_eval_queries, "test": d.max_eval_queries}
    queries: dict[str, dict[str, str]] = {}
    qrels: dict[str, dict[str, dict[str, int]]] = {}
    info: dict[str, Query] = {}
    for split in SPLITS:
        pool = {q.id: q for q in by_split[split]}
        kept = _seeded_sample(sorted(pool), caps[split], d.seed, split)
        queries[split] = {qid: pool[qid].text for qid in kept}
        qrels[split] = {qid: {pool[qid].section_id: 1} for qid in kept}
        info.update({qid: pool[qid] for qid in kept})
    if not queries["test"]:
        raise DatasetError("the split leaves no test queries; raise test_fraction or add laws")
    if not queries["train"]:
        raise DatasetError("the split leaves no training queries; lower dev_fraction/test_fraction or add laws")

    settings = {
        **d.model_dump(exclude={"hard_negatives", "num_negatives", "negative_margin", "negative_range_max"}),
        "max_seq_length": cfg.max_seq_length,
    }
    source = source_id(root)
    if source is not None:  # fetched data names its commit; a folder filled by hand keeps the old digest
        settings["source"] = source
    dataset = RetrievalDataset(
        sections=sections, corpus=corpus, queries=queries, qrels=qrels, query_info=info,
        split_of_section=split_of_section, digest="", settings=settings,
    )
    dataset.digest = compute_digest(dataset)
    check_no_leakage(dataset)
    return dataset


def compute_digest(dataset: RetrievalDataset) -> str:
    content = {
        "settings": dataset.settings,
        "corpus": [[c.id, c.text] for c in dataset.corpus.values()],
        "queries": dataset.queries,
        "qrels": dataset.qrels,
    }
    if dataset.given_negatives:
        content["negatives"] = dataset.given_negatives
    blob = json.dumps(content, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def check_no_leakage(dataset: RetrievalDataset) -> None:
    """Raise if a dev or test section is a training positive, or a query sits in two splits."""
    positives = {split: {sid for rel in dataset.qrels[split].values() for sid in rel} for split in SPLITS}
    for held_out in ("dev", "test"):
        overlap = positives["train"] & positives[held_out]
        if overlap:
            raise AssertionError(f"{held_out} sections are training positives: {sorted(overlap)[:5]}")
    if positives["dev"] & positives["test"]:
        raise AssertionError("a section is relevant in both dev and test")
    ids = [qid for split in SPLITS for qid in dataset.queries[split]]
    if len(ids) != len(set(ids)):
        raise AssertionError("a query appears in more than one split")
    train_texts = {dataset.first_chunk(s).text for s in positives["train"]}
    held_texts = {dataset.first_chunk(s).text for s in positives["dev"] | positives["test"]}
    # Identical text in two sections would make a held-out section a training positive in all but name.
    if train_texts & held_texts:
        raise AssertionError("a held-out section's text is identical to a training positive's")


def law_file_digest(root: Path, stems: list[str]) -> dict[str, str]:
    """sha256 of each law file, for the report (the dataset digest already covers their parsed content)."""
    return {s: hashlib.sha256(law_path(root, s).read_bytes()).hexdigest()[:16] for s in stems}


__all__ = [
    "SPLITS", "Chunk", "DataDirError", "DatasetError", "Query", "RetrievalDataset", "build_dataset",
    "check_no_leakage", "chunk_text", "citation_queries", "compute_digest",
]
