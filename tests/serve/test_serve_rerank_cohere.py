"""The Cohere client against a real cluster: `cohere.ClientV2(base_url=…).rerank(...)` reaches /v2/rerank.

A real cluster (nats-server, one worker, the gateway) serves the packaged MiniLM as a cross-encoder, saved with its
seeded head (a checkpoint that ships its head, as hub cross-encoders do). The client's scores equal
CrossEncoder.predict on the same pairs, its results come sorted and cut to top_n, and an unknown model is the
client's NotFoundError (a 404 as on the other routes). The default fleet's `all-MiniLM-L6-v2-ce` (the head drawn at
load) is refused to the client with a 409 that says to train and promote a rerank specialist (issue 44).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from lorafleet.core.config import PACKAGED_MINILM, FleetConfig
from lorafleet.ops.cluster import LocalCluster

cohere = pytest.importorskip("cohere")  # in the dev extras; skipped only where it is not installed

pytestmark = pytest.mark.integration

CE = "minilm-ce"
BASE = "all-MiniLM-L6-v2-ce"  # as configs/fleet.yaml serves it: no head in the checkpoint
QUERY = "Wer zahlt den Kaufpreis?"
DOCS = ["Der Käufer ist verpflichtet, dem Verkäufer den vereinbarten Kaufpreis zu zahlen.",
        "Arbeitnehmer haben Anspruch auf bezahlten Erholungsurlaub.",
        "The buyer must pay the purchase price.",
        "Die Kündigung bedarf der Schriftform.",
        "Cats sleep most of the day."]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    from lorafleet.core.model_source import resolve_model_source
    from lorafleet.sidecar.ce_runtime import load_cross_encoder

    saved = tmp_path_factory.mktemp("cohere-ce") / CE  # with the head every worker would draw: the same scores
    load_cross_encoder(resolve_model_source(PACKAGED_MINILM)).save_pretrained(str(saved))
    cfg = FleetConfig.model_validate({
        "bases": [{"name": CE, "source": str(saved), "runtime": "cross-encoder"},
                  {"name": BASE, "source": PACKAGED_MINILM, "runtime": "cross-encoder"}],
        "gateway": {"port": 0, "default_deadline_s": 60},
        "worker": {"heartbeat_s": 0.3, "device": "cpu"},
        "queue": {"storage": "memory"},
    })
    with LocalCluster(cfg, workers=1, port=0, home=tmp_path_factory.mktemp("cohere-home")) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> object:
    return cohere.ClientV2(api_key="unused", base_url=cluster.gateway_url, timeout=120)


def _predict(docs: list[str]) -> np.ndarray:
    import torch
    from sentence_transformers.cross_encoder import CrossEncoder

    from lorafleet.core.model_source import resolve_model_source

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the seed every worker draws the missing head from
        model = CrossEncoder(resolve_model_source(PACKAGED_MINILM), num_labels=1, device="cpu")
    return np.asarray(model.predict([[QUERY, d] for d in docs]), dtype=np.float32)


def test_cohere_client_rerank_equals_crossencoder_predict(client: object) -> None:
    got = client.rerank(model=CE, query=QUERY, documents=DOCS)  # type: ignore[attr-defined]
    want = _predict(DOCS)
    assert sorted(r.index for r in got.results) == list(range(len(DOCS)))
    scores = [r.relevance_score for r in got.results]
    assert scores == sorted(scores, reverse=True)
    by_index = np.array([r.relevance_score for r in sorted(got.results, key=lambda r: r.index)], dtype=np.float32)
    np.testing.assert_allclose(by_index, want, rtol=0, atol=1e-5)


def test_cohere_client_top_n(client: object) -> None:
    got = client.rerank(model=CE, query=QUERY, documents=DOCS, top_n=2)  # type: ignore[attr-defined]
    want = _predict(DOCS)
    assert [r.index for r in got.results] == [int(i) for i in np.argsort(-want, kind="stable")[:2]]


def test_cohere_client_unknown_model_is_not_found(client: object) -> None:
    with pytest.raises(cohere.NotFoundError) as info:
        client.rerank(model="no-such-reranker", query=QUERY, documents=DOCS)  # type: ignore[attr-defined]
    assert "no-such-reranker" in str(info.value.body)


def test_cohere_client_on_a_drawn_head_base_is_told_what_to_do(client: object) -> None:
    with pytest.raises(cohere.core.api_error.ApiError) as info:
        client.rerank(model=BASE, query=QUERY, documents=DOCS, top_n=2)  # type: ignore[attr-defined]
    assert info.value.status_code == 409, info.value
    body = info.value.body
    assert body["error"]["code"] == "untrained_head", body
    assert "lorafleet promote" in body["error"]["message"] and "research run" in body["error"]["message"]
