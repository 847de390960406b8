"""A registered embedding specialist as the rerank pipeline's first stage (`models:/NAME/N`), on a real MLflow store.

A LoRA on the tiny BERT is registered as a bundle; the rerank kind's dense (and hybrid) first stage names it by
`models:/NAME/N` and by `models:/NAME@alias`, resolved through the core adapter sources (the registry's plugin
downloads and verifies the bundle). Its ranking is the one the specialist itself gives (base + LoRA), not the
bare base's; a malformed URI is refused when the config is read, an unknown one when it is resolved.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lorafleet.core.adapters import AdapterUnavailable

WORDS = [a + b for a in ["ka", "lo", "mi", "ru", "sen", "tav", "po", "lin", "dar", "fel"]
         for b in ["ga", "te", "bo", "ni", "su", "ver", "dul", "mar"]]  # 80 pseudo-words
N_DOCS = 30


def _docs() -> list[tuple[str, str]]:
    own = [[WORDS[(2 * i + j) % len(WORDS)] for j in range(4)] for i in range(N_DOCS)]
    return [(f"{w[0]} {w[2]}", " ".join(w * 3)) for w in own]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The tiny BERT, a random LoRA on it (the 'embedding specialist'), and a pairs table."""
    from lorafleet.testing import build_tiny_model, make_random_adapter

    root = tmp_path_factory.mktemp("rerank-first-stage")
    docs = _docs()
    model = build_tiny_model(root / "bert", corpus=[t for pair in docs for t in pair], vocab_size=200,
                             max_seq_length=32)
    adapter = make_random_adapter(model, root / "embed-lora", seed=4, scale=2.0)
    with (root / "pairs.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["query", "positive"])
        writer.writerows(docs)
    return model, adapter, root / "pairs.csv"


def _cfg(model: Path, pairs: Path, embedder: str, kind: str = "dense") -> Any:
    from lorafleet.core.tasks import get_task_kind

    return get_task_kind("rerank").parse_config({
        "base_model": str(model),
        "data": {"layout": "pairs", "pairs": str(pairs), "num_negatives": 1, "dev_fraction": 0.3,
                 "test_fraction": 0.2},
        "first_stage": {"kind": kind, "embedder": embedder, "depth": 5},
        "max_seq_length": 32, "max_pair_length": 48, "device": "cpu",
    })


def test_registered_specialist_is_the_first_stage(setup: tuple[Path, Path, Path], _isolated_home: Path) -> None:
    from lorafleet.core.tasks import get_task_kind
    from lorafleet.registry import store
    from lorafleet.train.kinds.rerank.evaluate import first_stage_ranking, pipeline_metrics
    from lorafleet.train.kinds.retrieval.evaluate import DenseEvaluator, SectionIndex, _encode
    from lorafleet.train.kinds.retrieval.trainer import load_adapter_model, load_base_model

    model, adapter, pairs = setup
    ref = store.register_bundle("legal-embed", adapter, base_source=str(model), base_name="tiny",
                                alias="champion")
    kind = get_task_kind("rerank")
    cfg = _cfg(model, pairs, f"models:/legal-embed/{ref.version}")
    dataset = kind.build_dataset(cfg)
    data = dataset.retrieval
    got = first_stage_ranking(dataset, cfg.first_stage, "dev")

    def ranking(encoder: Any) -> Any:  # what the dense first stage computes, by hand
        dense = DenseEvaluator(data, 64)
        dense.encode_corpus(encoder)
        qids = list(data.queries["dev"])
        scores = _encode(encoder, [data.queries["dev"][q] for q in qids], 64) @ dense.corpus_embeddings.T
        return SectionIndex(data).rank(qids, scores, 100)

    specialist = ranking(load_adapter_model(str(model), adapter, "cpu", 32))
    bare = ranking(load_base_model(str(model), "cpu", 32))
    assert specialist != bare  # the LoRA changes the ranking: the test can tell which model ranked
    assert got.keys() == specialist.keys()
    for qid in got:
        assert [d for d, _ in got[qid]] == [d for d, _ in specialist[qid]]
        np.testing.assert_allclose([s for _, s in got[qid]], [s for _, s in specialist[qid]], atol=1e-5)

    # The alias names the same version; the hybrid stage fuses it with BM25; the pipeline reports it as its first.
    by_alias = _cfg(model, pairs, "models:/legal-embed@champion", kind="hybrid")
    m = pipeline_metrics(None, kind.build_dataset(by_alias), by_alias.first_stage, "dev")
    assert 0.0 <= m["first_dev_ndcg@10"] <= 1.0 and "first_dev_recall@depth" in m
    assert kind.bundle_details(by_alias)["pipeline"]["embedder"] == "models:/legal-embed@champion"


def test_bad_registry_references(setup: tuple[Path, Path, Path], _isolated_home: Path) -> None:
    from lorafleet.core.config import ConfigError
    from lorafleet.train.kinds.rerank.evaluate import first_stage_ranking

    model, _, pairs = setup
    with pytest.raises(ConfigError, match=r"first_stage\.embedder.*models:/NAME/VERSION"):
        _cfg(model, pairs, "models:/no version")
    cfg = _cfg(model, pairs, "models:/never-registered/1")
    from lorafleet.core.tasks import get_task_kind

    dataset = get_task_kind("rerank").build_dataset(cfg)
    with pytest.raises(AdapterUnavailable, match="never-registered"):
        first_stage_ranking(dataset, cfg.first_stage, "dev")
