"""End to end through a real local cluster: nats-server (JetStream), worker processes, the gateway,
and the packaged all-MiniLM-L6-v2. Nothing here is faked."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgpack
import nats
import numpy as np
import pytest

from lorafleet.core.config import BaseModelSpec, FleetConfig, QueueConfig, ServedModel
from lorafleet.ops.cluster import LocalCluster
from lorafleet.testing import wait_until

pytestmark = pytest.mark.integration

BASE = "all-MiniLM-L6-v2"
SENTENCES = [
    "Der Verkäufer einer Sache ist verpflichtet, dem Käufer die Sache zu übergeben.",
    "Die Kündigung bedarf zu ihrer Wirksamkeit der Schriftform.",
    "Wer vorsätzlich oder fahrlässig das Leben eines anderen verletzt, ist zum Ersatz verpflichtet.",
    "The quick brown fox jumps over the lazy dog.",
    "Arbeitnehmer haben Anspruch auf einen bezahlten Erholungsurlaub.",
]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> dict[str, Path]:
    from lorafleet.testing import make_random_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {
        "legal-a": make_random_adapter(minilm_path, root / "a", seed=1),
        "legal-b": make_random_adapter(minilm_path, root / "b", seed=2),
    }


@pytest.fixture(scope="module")
def reference(minilm_path: Path, adapters: dict[str, Path]) -> dict[str, np.ndarray]:
    """Direct in-process encodes: the base model, and base + each adapter loaded with load_adapter."""
    from sentence_transformers import SentenceTransformer

    out = {}
    model = SentenceTransformer(str(minilm_path), device="cpu")
    out[BASE] = model.encode(SENTENCES)
    for name, path in adapters.items():
        m = SentenceTransformer(str(minilm_path), device="cpu")
        m.load_adapter(str(path))
        out[name] = m.encode(SENTENCES)
        assert cosine(out[name], out[BASE]).min() < 0.999, "the random adapter should change the embeddings"
    return out


def _fleet(adapters: dict[str, Path], **queue: object) -> FleetConfig:
    return FleetConfig(
        bases=[BaseModelSpec(name=BASE)],
        models=[ServedModel(name=n, base=BASE, adapter=str(p)) for n, p in adapters.items()],
        queue=QueueConfig(**queue),
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Path]):
    home = tmp_path_factory.mktemp("cluster-home")
    c = LocalCluster(_fleet(adapters), workers=1, port=0, home=home)
    c.start(timeout=240)
    try:
        yield c
    finally:
        c.stop()


def test_openai_client_single_and_list(cluster: LocalCluster, reference: dict[str, np.ndarray]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0)
    single = client.embeddings.create(model=BASE, input=SENTENCES[0])  # the client asks for base64
    assert len(single.data) == 1
    assert cosine(single.data[0].embedding, reference[BASE][0]) > 0.9999
    assert single.usage.prompt_tokens > 5

    many = client.embeddings.create(model=BASE, input=SENTENCES, encoding_format="float")
    assert [d.index for d in many.data] == list(range(len(SENTENCES)))
    got = np.array([d.embedding for d in many.data])
    assert cosine(got, reference[BASE]).min() > 0.9999


def test_msgpack_route(cluster: LocalCluster, reference: dict[str, np.ndarray]) -> None:
    body = msgpack.packb({"inputs": SENTENCES})
    r = httpx.post(f"{cluster.gateway_url}/v1/encode/{BASE}", content=body,
                   headers={"Content-Type": "application/msgpack"}, timeout=60)
    assert r.status_code == 200, r.text
    out = msgpack.unpackb(r.content)
    vecs = np.stack([np.frombuffer(v, dtype="<f4") for v in out["vectors"]])
    assert out["dim"] == vecs.shape[1] == 384
    assert cosine(vecs, reference[BASE]).min() > 0.9999


def test_base64_encoding_matches_float(cluster: LocalCluster) -> None:
    url = f"{cluster.gateway_url}/v1/embeddings"
    f = httpx.post(url, json={"model": BASE, "input": SENTENCES[1]}, timeout=60).json()
    b = httpx.post(url, json={"model": BASE, "input": SENTENCES[1], "encoding_format": "base64"}, timeout=60).json()
    decoded = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), dtype="<f4")
    assert cosine(decoded, np.array(f["data"][0]["embedding"])) > 0.99999


def test_worker_runs_with_its_share_of_the_host(cluster: LocalCluster) -> None:
    """`up` passes each worker its thread count (lorafleet/ops/threads.py) and the worker sizes torch with it."""
    n = cluster.threads.worker
    assert cluster._argv["worker-1"][-2:] == ["--threads", str(n)]
    log = (cluster.home / "logs" / "worker-1.log").read_text()
    assert f"threads: {n} torch thread(s) per worker" in log


def test_two_adapters_one_worker(cluster: LocalCluster, reference: dict[str, np.ndarray]) -> None:
    """One worker serves the base and two adapters of it, requests interleaved."""
    url = f"{cluster.gateway_url}/v1/embeddings"

    def call(model: str) -> tuple[str, np.ndarray]:
        r = httpx.post(url, json={"model": model, "input": SENTENCES, "encoding_format": "float"}, timeout=120)
        assert r.status_code == 200, r.text
        return model, np.array([d["embedding"] for d in r.json()["data"]])

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(call, ["legal-a", "legal-b", BASE, "legal-b", "legal-a", BASE]))
    for model, vecs in results:
        assert cosine(vecs, reference[model]).min() > 0.9999, model
    models = httpx.get(f"{cluster.gateway_url}/v1/models", timeout=10).json()
    assert {m["id"] for m in models["data"]} >= {BASE, "legal-a", "legal-b"}


def _fire(url: str, n_requests: int, per_request: int, deadline_ms: int = 60_000) -> list[httpx.Response]:
    texts = [[f"Satz {i}.{j}: {SENTENCES[(i + j) % len(SENTENCES)]}" for j in range(per_request)]
             for i in range(n_requests)]

    def call(batch: list[str]) -> httpx.Response:
        return httpx.post(f"{url}/v1/embeddings", json={"model": BASE, "input": batch, "encoding_format": "float"},
                          headers={"X-Lorafleet-Deadline-Ms": str(deadline_ms)}, timeout=120)

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(call, texts))


def test_kill_9_worker_loses_nothing(tmp_path: Path, adapters: dict[str, Path], minilm_path: Path) -> None:
    """kill -9 a worker that holds un-acked tasks: every request is still answered, once, correctly."""
    from lorafleet.core.wire import consumer_name

    fleet = _fleet({}, ack_wait_s=2.0, max_deliver=5)
    with LocalCluster(fleet, workers=2, port=0, home=tmp_path / "home") as c:
        n_req, per = 48, 8
        box: dict[str, list[httpx.Response]] = {}

        async def consumer_info() -> Any:
            nc = await nats.connect(c.nats_url, **c.client_options("admin"))  # authentication is on
            try:
                return await nc.jetstream().consumer_info(fleet.queue.stream, consumer_name(BASE))
            finally:
                await nc.drain()

        t = threading.Thread(target=lambda: box.setdefault("r", _fire(c.gateway_url, n_req, per)))
        t.start()
        # Kill while a backlog waits and tasks are held: then both workers hold a batch (each pulls when idle).
        deadline = time.monotonic() + 60
        while True:
            info = asyncio.run(consumer_info())
            if info.num_pending > 0 and info.num_ack_pending > 0:
                break
            assert time.monotonic() < deadline, f"no backlog with held tasks within 60 s: {info}"
            time.sleep(0.05)
        c.kill_worker("worker-1", signal.SIGKILL)
        t.join(timeout=180)
        responses = box["r"]

        # Every delivery bumps the consumer sequence; every task the stream sequence once.
        info = asyncio.run(consumer_info())
        n_redelivered = info.delivered.consumer_seq - info.delivered.stream_seq

    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_path), device="cpu")
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200][:3]
    for i, r in enumerate(responses):
        data = r.json()["data"]
        assert [d["index"] for d in data] == list(range(per))  # none duplicated, none missing, in order
        texts = [f"Satz {i}.{j}: {SENTENCES[(i + j) % len(SENTENCES)]}" for j in range(per)]
        assert cosine(np.array([d["embedding"] for d in data]), model.encode(texts)).min() > 0.9999
    assert n_redelivered > 0, "the killed worker held no un-acked task; the test proved nothing"


async def _stream_messages(c: LocalCluster) -> int:
    nc = await nats.connect(c.nats_url, **c.client_options("admin"))
    try:
        return (await nc.jetstream().stream_info(c.fleet.queue.stream)).state.messages
    finally:
        await nc.close()


def test_nats_restart_keeps_waiting_tasks(tmp_path: Path, minilm_path: Path) -> None:
    """Tasks accepted into the file-backed stream survive a nats-server restart and are served after it."""
    fleet = _fleet({})
    with LocalCluster(fleet, workers=1, port=0, home=tmp_path / "home") as c:
        worker = c.procs["worker-1"]
        os.kill(worker.pid, signal.SIGSTOP)  # a paused worker: the tasks wait in the stream
        try:
            box: dict[str, list[httpx.Response]] = {}
            t = threading.Thread(target=lambda: box.setdefault("r", _fire(c.gateway_url, 4, 3)))
            t.start()
            # Restart once every task (4 requests × 3 inputs) is in the file-backed stream.
            wait_until(lambda: asyncio.run(_stream_messages(c)) >= 12, 60, "12 tasks in the work stream")
            c.nats.restart()
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        t.join(timeout=120)
        responses = box["r"]
        assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
        after = httpx.post(f"{c.gateway_url}/v1/embeddings", json={"model": BASE, "input": "nach dem Neustart"},
                           timeout=60)
        assert after.status_code == 200, after.text
