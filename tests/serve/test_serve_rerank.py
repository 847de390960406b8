"""Reranking end to end: a real cluster (nats-server, one worker, the gateway) serving the packaged MiniLM twice as
a cross-encoder base: `all-MiniLM-L6-v2-ce` as the default fleet does (no head in the checkpoint: one is drawn at
load) with a LoRA specialist that carries its own head, and `minilm-ce`, the same model saved with its (seeded)
head, as a hub cross-encoder ships one; a tiny cross-encoder saved as transformers saves a sequence classifier;
an embedding base beside them.

Scores through /v1/rerank, /v2/rerank, /rerank (Jina and TEI shapes) and the MessagePack /v1/score equal
CrossEncoder.predict; results are sorted, cut to top_n, carry documents when asked; a request of 100
documents travels as several tasks and is answered in full; bad input gets a 400 that names the fix.
The base whose head was drawn answers 409 through every shape, and `lorafleet rerank`, with what to do (issue 44);
its specialist and the checkpoints that ship their head answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest

from lorafleet.core.config import PACKAGED_MINILM, FleetConfig
from lorafleet.ops.cluster import LocalCluster

pytestmark = pytest.mark.integration

CE = "minilm-ce"  # saved with its head: a reranker by itself
BASE = "all-MiniLM-L6-v2-ce"  # as configs/fleet.yaml serves it: the head drawn at load, only ce-a answers on it
HUB = "tiny-hub-ce"
QUERY = "who pays the purchase price?"
DOCS = ["The buyer must pay the purchase price.", "Cats sleep most of the day.", "Der Käufer zahlt den Kaufpreis.",
        "Stocks fell sharply on Monday.", "payment of the price is due on delivery",
        "The buyer must pay the purchase price."]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA on the MiniLM cross-encoder that saves its own head (modules_to_save), noise for weights."""
    from lorafleet.core.model_source import resolve_model_source
    from lorafleet.sidecar.ce_runtime import load_cross_encoder
    from lorafleet.testing import add_random_ce_adapter

    out = tmp_path_factory.mktemp("ce-adapter") / "ce-a"
    model = load_cross_encoder(resolve_model_source(PACKAGED_MINILM))
    add_random_ce_adapter(model, "ce-a", r=4, seed=7, scale=0.2)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def with_head(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints that ship their score head: the MiniLM cross-encoder saved with the head every worker draws
    (so its scores are the drawn head's), and a tiny BertForSequenceClassification saved by transformers (as
    hub cross-encoders are: no sentence-transformers files)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from lorafleet.core.model_source import resolve_model_source
    from lorafleet.sidecar.ce_runtime import load_cross_encoder

    out = tmp_path_factory.mktemp("with-head")
    load_cross_encoder(resolve_model_source(PACKAGED_MINILM)).save_pretrained(str(out / CE))
    config = BertConfig.from_pretrained(str(tiny_model_dir), num_labels=1,
                                        architectures=["BertForSequenceClassification"])
    torch.manual_seed(11)
    BertForSequenceClassification(config).save_pretrained(str(out / HUB))
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(str(out / HUB))
    return {CE: out / CE, HUB: out / HUB}


@pytest.fixture(scope="module")
def reference(adapter_dir: Path, with_head: dict[str, Path]) -> Any:
    """CrossEncoder.predict of (served name, documents), computed here like a client would."""
    import torch
    from sentence_transformers.cross_encoder import CrossEncoder

    from lorafleet.core.model_source import resolve_model_source

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the seed every worker draws the missing head from
        base = CrossEncoder(resolve_model_source(PACKAGED_MINILM), num_labels=1, device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tuned = CrossEncoder(resolve_model_source(PACKAGED_MINILM), num_labels=1, device="cpu")
    tuned.load_adapter(str(adapter_dir), adapter_name="ce-a")
    tuned.model.set_adapter("ce-a")
    hub = CrossEncoder(str(with_head[HUB]), num_labels=1, device="cpu")

    def predict(name: str, docs: list[str]) -> np.ndarray:
        model = {CE: base, HUB: hub}.get(name, tuned)
        return np.asarray(model.predict([[QUERY, d] for d in docs]), dtype=np.float32)

    return predict


@pytest.fixture(scope="module")
def cluster(adapter_dir: Path, with_head: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[LocalCluster]:
    cfg = FleetConfig.model_validate({
        "bases": [{"name": CE, "source": str(with_head[CE]), "runtime": "cross-encoder"},
                  {"name": BASE, "source": PACKAGED_MINILM, "runtime": "cross-encoder"},
                  {"name": HUB, "source": str(with_head[HUB]), "runtime": "cross-encoder"},
                  {"name": "minilm", "source": PACKAGED_MINILM}],
        "models": [{"name": "ce-a", "base": BASE, "adapter": str(adapter_dir), "adapter_id": "ce-a"}],
        "gateway": {"port": 0, "default_deadline_s": 60, "rerank_chunk": 16, "max_rerank_documents": 200},
        "worker": {"heartbeat_s": 0.3, "device": "cpu", "adapter_roots": [str(adapter_dir.parent)]},
        "queue": {"storage": "memory"},
    })
    home = tmp_path_factory.mktemp("rerank-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAFLEET_CLOCK_SKEW_S", "0")
        with LocalCluster(cfg, workers=1, port=0, home=home) as c:
            yield c


@pytest.fixture
def http(cluster: LocalCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.gateway_url, timeout=120) as client:
        yield client


@pytest.mark.parametrize("name", [CE, "ce-a", HUB])
@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank", "/rerank"])
def test_scores_equal_crossencoder_predict_sorted(http: httpx.Client, reference: Any, name: str, path: str) -> None:
    r = http.post(path, json={"model": name, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == name and body["usage"]["total_tokens"] > 0
    want = reference(name, DOCS)
    results = body["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    got = np.array([x["relevance_score"] for x in sorted(results, key=lambda x: x["index"])], dtype=np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    assert results.index(next(x for x in results if x["index"] == 0)) < \
        results.index(next(x for x in results if x["index"] == 5))  # equal documents: input order kept
    assert all("document" not in x for x in results)


def test_top_n_and_return_documents(http: httpx.Client, reference: Any) -> None:
    r = http.post("/v1/rerank", json={"model": CE, "query": QUERY, "documents": [{"text": d} for d in DOCS],
                                      "top_n": 2, "return_documents": True})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    want = reference(CE, DOCS)
    top = [int(i) for i in sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]]
    assert [x["index"] for x in results] == top
    assert [x["document"] for x in results] == [{"text": DOCS[i]} for i in top]


def test_tei_shape(http: httpx.Client, reference: Any) -> None:
    r = http.post("/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True})  # the one reranker
    # CE, ce-a and HUB (not BASE: it is no reranker by itself): name one
    assert r.status_code == 400 and f"3 rerankers (ce-a, {CE}, {HUB})" in r.json()["error"]["message"], r.text
    r = http.post("/rerank", json={"model": "ce-a", "query": QUERY, "texts": DOCS, "return_text": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body, list) and len(body) == len(DOCS)
    want = reference("ce-a", DOCS)
    for x in body:
        assert x["text"] == DOCS[x["index"]] and abs(x["score"] - want[x["index"]]) < 1e-5
    assert [x["score"] for x in body] == sorted((x["score"] for x in body), reverse=True)


def test_msgpack_score_route(http: httpx.Client, reference: Any) -> None:
    r = http.post(f"/v1/score/{CE}", content=msgpack.packb({"query": QUERY, "documents": DOCS}),
                  headers={"content-type": "application/msgpack"})
    assert r.status_code == 200, r.text
    body = msgpack.unpackb(r.content)
    np.testing.assert_allclose(np.frombuffer(body["scores"], dtype="<f4"), reference(CE, DOCS), rtol=0, atol=1e-5)


def test_hundred_documents_in_chunks_answered_in_full(http: httpx.Client, reference: Any,
                                                      cluster: LocalCluster) -> None:
    docs = [f"document {i}: " + DOCS[i % len(DOCS)] + " word" * (i % 13) for i in range(100)]
    docs[42] = "long " * 600  # over the model's 512 tokens: truncated, and said so
    before = _published(cluster, BASE)
    r = http.post("/v1/rerank", json={"model": "ce-a", "query": QUERY, "documents": docs})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["results"]) == 100 and body["truncated"] == [42] and body["meta"]["warnings"]
    got = np.array([x["relevance_score"] for x in sorted(body["results"], key=lambda x: x["index"])])
    np.testing.assert_allclose(got, reference("ce-a", docs), rtol=0, atol=1e-5)
    assert _published(cluster, BASE) - before == 7  # 100 documents, 16 per task (gateway.rerank_chunk)


def _published(cluster: LocalCluster, base: str) -> float:
    metrics = httpx.get(f"{cluster.gateway_url}/metrics").text
    line = next((x for x in metrics.splitlines()
                 if x.startswith("lorafleet_gateway_tasks_published_total") and f'base="{base}"' in x), None)
    return float(line.split()[-1]) if line else 0.0


@pytest.mark.parametrize(("body", "code", "fix"), [
    ({"model": CE, "query": "", "documents": DOCS}, "empty_query", "'query' is empty"),
    ({"model": CE, "query": QUERY, "documents": []}, "empty_documents", "at least one document"),
    ({"model": CE, "query": QUERY, "documents": ["d"] * 201}, "too_many_documents", "max_rerank_documents"),
    ({"model": CE, "query": QUERY, "documents": ["ok", 3]}, "invalid_document", "documents[1]"),
    ({"model": CE, "query": QUERY, "documents": [{"txt": "x"}]}, "invalid_document", "{\"text\": str}"),
    ({"model": CE, "query": QUERY, "documents": DOCS, "top_n": 0}, "invalid_top_n", "positive integer"),
    ({"model": CE, "query": QUERY, "documents": DOCS, "top_n": -2}, "invalid_top_n", "positive integer"),
    ({"model": CE, "query": QUERY}, "missing_documents", "'documents' is missing"),
    ({"model": "minilm", "query": QUERY, "documents": DOCS}, "wrong_route", "/v1/embeddings"),
])
def test_bad_input_is_400_naming_the_fix(http: httpx.Client, body: dict[str, Any], code: str, fix: str) -> None:
    r = http.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and fix in err["message"], err


def test_unknown_model_and_wrong_routes(http: httpx.Client) -> None:
    r = http.post("/v1/rerank", json={"model": "nope", "query": QUERY, "documents": DOCS})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for path, body in (("/v1/embeddings", {"model": "ce-a", "input": "x"}),
                       ("/v1/chat/completions", {"model": CE, "messages": [{"role": "user", "content": "x"}]})):
        r = http.post(path, json=body)
        assert r.status_code == 400 and "/v1/rerank" in r.json()["error"]["message"], (path, r.text)
    rows = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert rows[CE]["kind"] == rows["ce-a"]["kind"] == rows[HUB]["kind"] == "reranker"
    assert rows[CE]["trained_head"] is rows["ce-a"]["trained_head"] is rows[HUB]["trained_head"] is True
    assert rows[BASE]["kind"] == "rerank-base" and rows[BASE]["trained_head"] is False  # issue 44
    assert rows["ce-a"]["root"] == BASE
    assert rows["minilm"]["kind"] == "embedding" and "trained_head" not in rows["minilm"]


def _refused(r: httpx.Response) -> str:
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "untrained_head", err
    message: str = err["message"]
    assert BASE in message and "lorafleet research run configs/german-legal-rerank.yaml" in message
    assert "lorafleet promote" in message and "docs/ship.md" in message
    return message


@pytest.mark.parametrize(("path", "body"), [
    ("/v2/rerank", {"model": BASE, "query": QUERY, "documents": DOCS, "top_n": 2}),  # Cohere v2
    ("/v1/rerank", {"model": BASE, "query": QUERY, "documents": [{"text": d} for d in DOCS]}),  # Jina, vLLM
    ("/rerank", {"model": BASE, "query": QUERY, "documents": DOCS}),  # Jina's path (LlamaIndex JinaRerank)
    ("/rerank", {"model": BASE, "query": QUERY, "texts": DOCS, "return_text": True}),  # TEI
])
def test_a_drawn_head_base_is_refused_with_what_to_do(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    """Issue 44: the default fleet's -ce base ranks at chance by itself; it says so, and what to do instead."""
    _refused(http.post(path, json=body))


def test_a_drawn_head_base_msgpack_and_cli_say_the_same(http: httpx.Client, cluster: LocalCluster) -> None:
    import subprocess
    import sys

    message = _refused(http.post(f"/v1/score/{BASE}", content=msgpack.packb({"query": QUERY, "documents": DOCS}),
                                 headers={"content-type": "application/msgpack"}))
    out = subprocess.run([sys.executable, "-m", "lorafleet", "rerank", "--url", cluster.gateway_url, "--model", BASE,
                          QUERY, *DOCS], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and not out.stdout.strip(), out
    assert message in " ".join(out.stderr.split()), out.stderr  # the same words (a terminal may wrap them)


def test_cli_rerank(cluster: LocalCluster, reference: Any) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lorafleet", "rerank", "--url", cluster.gateway_url, "--model", CE,
                          "--top-n", "2", QUERY, *DOCS], capture_output=True, text=True, timeout=120, check=True)
    want = reference(CE, DOCS)
    best = sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
    lines = out.stdout.strip().splitlines()
    assert [int(line.split("]")[0][1:]) for line in lines] == best, out.stdout
    assert "tokens" in out.stderr
