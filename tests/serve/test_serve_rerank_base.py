"""The gateway's view of a cross-encoder base whose head is drawn at load (issue 44): `rerank-base` in /v1/models,
never the model a TEI request without `model` means, refused 409 with what to do when it is the only one.

A tiny random BERT stands in for the packaged MiniLM (no head in the checkpoint), the same BERT saved as a
CrossEncoder for a hub cross-encoder (its head in the checkpoint). End to end: tests/serve/test_serve_rerank.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lorafleet.core.config import BaseModelSpec
from lorafleet.core.wire import EMBED, SCORE
from lorafleet.serve.bases import RERANK_BASE, BaseInfo, load_base
from lorafleet.serve.errors import ApiError
from lorafleet.serve.rerank import only_reranker
from lorafleet.serve.resolver import Route


@pytest.fixture(scope="module")
def with_head(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorafleet.sidecar.ce_runtime import load_cross_encoder

    out = tmp_path_factory.mktemp("ce-head") / "with-head"
    load_cross_encoder(str(tiny_model_dir)).save_pretrained(str(out))
    return out


def test_the_gateway_view_marks_a_drawn_head_base(tiny_model_dir: Path, with_head: Path) -> None:
    drawn = load_base(BaseModelSpec(name="a-ce", source=str(tiny_model_dir), runtime="cross-encoder"))
    assert drawn.untrained and drawn.kind == RERANK_BASE
    assert drawn.model_fields(None) == {"trained_head": False}
    assert drawn.kind_of("spec") == "reranker" and drawn.model_fields("spec") == {"trained_head": True}
    shipped = load_base(BaseModelSpec(name="b-ce", source=str(with_head), runtime="cross-encoder"))
    assert not shipped.untrained and shipped.kind == "reranker" and shipped.model_fields(None) == {
        "trained_head": True}
    embedder = load_base(BaseModelSpec(name="e", source=str(tiny_model_dir)))
    assert not embedder.untrained and embedder.kind == "embedding" and embedder.model_fields(None) == {}


def _gateway(bases: dict[str, BaseInfo], routes: list[Route]) -> object:
    return SimpleNamespace(bases=bases, resolver=SimpleNamespace(routes=lambda: routes))


def test_a_tei_request_without_model_never_means_a_drawn_head_base() -> None:
    drawn, shipped = BaseInfo(None, None, SCORE, trained_head=False), BaseInfo(None, None, SCORE, trained_head=True)
    bases = {"all-MiniLM-L6-v2-ce": drawn, "hub-ce": shipped, "e": BaseInfo(None, None, EMBED)}
    base, spec = Route("all-MiniLM-L6-v2-ce", "all-MiniLM-L6-v2-ce"), Route("rr", "all-MiniLM-L6-v2-ce", "rr@1")
    assert only_reranker(_gateway(bases, [base, spec, Route("e", "e")])) == "rr"  # type: ignore[arg-type]
    assert only_reranker(_gateway(bases, [base, Route("hub-ce", "hub-ce")])) == "hub-ce"  # type: ignore[arg-type]
    with pytest.raises(ApiError) as info:  # the default fleet before any specialist: what to do, not "no reranker"
        only_reranker(_gateway(bases, [base, Route("e", "e")]))  # type: ignore[arg-type]
    assert info.value.status == 409 and info.value.code == "untrained_head"
    assert "lorafleet promote" in info.value.message
    with pytest.raises(ApiError) as info:
        only_reranker(_gateway(bases, [Route("e", "e")]))  # type: ignore[arg-type]
    assert info.value.status == 400 and "no reranker" in info.value.message
