"""`in_batch_negatives` is what the mnrl loss sees: 0 is none (sentence-transformers reads None as every other
document of the batch, and refuses 0), N is N, absent is the documented default (4). Counted on a tiny random
cross-encoder, batch 16, three mined negatives per query, by a spy on the pairs the loss scores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

BATCH, HARD = 16, 3
WORDS = ["kauf", "miete", "pacht", "leihe", "darlehen", "schenkung", "werk", "dienst", "auftrag", "bürgschaft"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from lorafleet.testing import build_tiny_model
    from lorafleet.train.kinds.rerank.evaluate import load_reranker

    path = build_tiny_model(tmp_path_factory.mktemp("ce") / "bert", corpus=[" ".join(WORDS)] * 4, vocab_size=120,
                            hidden=16, layers=1, heads=2)
    return load_reranker(str(path))


def _columns_scored(reranker: Any, monkeypatch: pytest.MonkeyPatch, **settings: Any) -> int:
    """How many (query, document) columns one forward of the configured loss scores for a batch of 16."""
    from lorafleet.train.kinds.rerank.config import RerankConfig
    from lorafleet.train.kinds.rerank.trainer import _loss

    loss = _loss(RerankConfig(**settings), reranker)
    seen: list[int] = []
    original = loss.call_model_with_columns

    def spy(anchors: list[str], candidates: list[str], **kw: Any) -> Any:
        seen.append(len(candidates))
        return original(anchors, candidates, **kw)

    monkeypatch.setattr(loss, "call_model_with_columns", spy)
    queries = [f"{WORDS[i % 10]} {WORDS[(i + 1) % 10]} {i}" for i in range(BATCH)]
    docs = [[f"{WORDS[(i + j) % 10]} regel {i}" for i in range(BATCH)] for j in range(1 + HARD)]
    value = loss([queries, *docs], None)
    value.backward()  # a real loss with a gradient, not a count of calls alone
    assert all(n == BATCH for n in seen)
    return len(seen)


def test_zero_in_batch_negatives_is_none(reranker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The positive and the 3 mined negatives, nothing else (before the fix: 1 + 60 in-batch + 3 = 64 columns).
    assert _columns_scored(reranker, monkeypatch, in_batch_negatives=0) == 1 + HARD


@pytest.mark.parametrize(("settings", "in_batch"), [({"in_batch_negatives": 2}, 2), ({}, 4),
                                                    ({"in_batch_negatives": 500}, BATCH * (1 + HARD) - (1 + HARD))])
def test_in_batch_negatives_counts(reranker: Any, monkeypatch: pytest.MonkeyPatch, settings: dict[str, int],
                                   in_batch: int) -> None:
    """N other documents per query; absent: the default 4; more than the batch holds: all of them (60)."""
    assert _columns_scored(reranker, monkeypatch, **settings) == 1 + in_batch + HARD


def test_null_in_batch_negatives_is_refused() -> None:
    from pydantic import ValidationError

    from lorafleet.train.kinds.rerank.config import RerankConfig

    assert RerankConfig().in_batch_negatives == 4
    with pytest.raises(ValidationError, match="in_batch_negatives"):
        RerankConfig(in_batch_negatives=None)  # type: ignore[arg-type]


def test_the_shipped_rerank_config_sets_a_count() -> None:
    import yaml

    raw = yaml.safe_load((Path(__file__).parents[2] / "configs" / "german-legal-rerank.yaml").read_text())
    assert isinstance(raw["train"]["in_batch_negatives"], int)
