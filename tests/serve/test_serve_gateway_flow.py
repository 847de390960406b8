"""The gateway's request path over real HTTP and a real nats-server, answered by a scripted worker.

The scripted worker (serve_harness.ScriptedWorker) pulls the real tasks from the real stream and
replies with vectors derived from the text, so these tests check what the gateway owns —
annotation, ordering, encodings, duplicates, error mapping — not the model (tests/integration
checks real embeddings through the real sidecar).
"""

from __future__ import annotations

import base64
import time

import httpx
import msgpack
import numpy as np
import pytest
from serve_harness import (
    BASE,
    answer,
    fake_vector,
    make_fleet,
    running_gateway,
    scripted_worker,
    until,
    wait_ready,
)

from lorafleet.core import wire
from lorafleet.core.config import ServedModel
from lorafleet.serve.tokens import TokenCounter

pytestmark = pytest.mark.integration

TEXTS = ["Der Käufer zahlt den Kaufpreis.", "Die Kündigung bedarf der Schriftform.", "kurz", "noch ein Satz hier"]


async def test_embeddings_float_and_base64_in_input_order(nats_server) -> None:
    fleet = make_fleet(nats_server.url)
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client, scripted_worker(nats_server.url, fleet.queue) as w:
            await wait_ready(client)
            r = await client.post("/v1/embeddings", json={"model": BASE, "input": TEXTS})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and body["model"] == BASE
            assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
            for text, d in zip(TEXTS, body["data"], strict=True):
                assert d["object"] == "embedding"
                np.testing.assert_array_equal(np.asarray(d["embedding"], dtype="<f4"), fake_vector(text))
            expected_tokens = sum(TokenCounter.for_source(BASE).count(TEXTS))
            assert body["usage"] == {"prompt_tokens": expected_tokens, "total_tokens": expected_tokens}

            req = {"model": BASE, "input": TEXTS[0], "encoding_format": "base64"}
            r = await client.post("/v1/embeddings", json=req)
            assert r.status_code == 200, r.text
            (d,) = r.json()["data"]
            vec = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
            np.testing.assert_array_equal(vec, fake_vector(TEXTS[0]))

            # The annotation each task carried.
            task = next(t for t in w.seen if t.text == TEXTS[1])
            assert task.base == BASE and task.model == BASE and task.adapter is None
            assert task.id == f"{task.request_id}.{task.index}" and task.index == 1
            assert task.reply == wire.reply_inbox(gw.gateway.gateway_id, task.request_id)
            assert 25 < task.deadline - task.enqueued <= 30.0 + 1e-6  # default_deadline_s
            assert task.tokens == TokenCounter.for_source(BASE).count([TEXTS[1]])[0]

        assert gw.metric("lorafleet_gateway_requests_total", route="embeddings", model=BASE, code="200") == 2
        assert gw.metric("lorafleet_gateway_batch_size_count", base=BASE) == len(TEXTS) + 1
        assert gw.metric("lorafleet_gateway_queue_wait_seconds_sum", base=BASE) == pytest.approx(0.003 * 5)


async def test_adapter_route_deadline_header_and_openai_client(nats_server) -> None:
    from openai import AsyncOpenAI

    adapter = ServedModel(name="german-legal", base=BASE, adapter="/bundles/german-legal/adapter", adapter_id="gl@3")
    fleet = make_fleet(nats_server.url, models=[adapter], api_keys=["sk-test"])
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client, scripted_worker(nats_server.url, fleet.queue) as w:
            await wait_ready(client)
            oai = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-test", max_retries=0)
            # The OpenAI client asks for base64 by default and decodes it to floats itself.
            res = await oai.embeddings.create(model="german-legal", input=TEXTS[:2])
            for text, d in zip(TEXTS[:2], res.data, strict=True):
                np.testing.assert_allclose(d.embedding, fake_vector(text), rtol=0, atol=0)
            models = await oai.models.list()
            assert {m.id for m in models.data} == {BASE, "german-legal"}
            await oai.close()

            r = await client.post("/v1/embeddings", json={"model": "german-legal", "input": "x"},
                                  headers={"Authorization": "Bearer sk-test", "X-Lorafleet-Deadline-Ms": "1500"})
            assert r.status_code == 200, r.text
            task = w.seen[-1]
            assert (task.model, task.base, task.adapter, task.adapter_uri) == (
                "german-legal", BASE, "gl@3", "/bundles/german-legal/adapter")
            assert task.deadline - task.enqueued == pytest.approx(1.5)


async def test_msgpack_encode_route(nats_server) -> None:
    fleet = make_fleet(nats_server.url)
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client, scripted_worker(nats_server.url, fleet.queue) as w:
            await wait_ready(client)
            body = msgpack.packb({"inputs": TEXTS, "deadline_ms": 2500})
            r = await client.post(f"/v1/encode/{BASE}", content=body,
                                  headers={"Content-Type": "application/msgpack", "X-Lorafleet-Deadline-Ms": "9000"})
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == "application/msgpack"
            out = msgpack.unpackb(r.content)
            assert out["model"] == BASE and out["dim"] == 8
            assert out["prompt_tokens"] == sum(TokenCounter.for_source(BASE).count(TEXTS))
            for text, raw in zip(TEXTS, out["vectors"], strict=True):
                np.testing.assert_array_equal(np.frombuffer(raw, dtype="<f4"), fake_vector(text))
            # The body's deadline_ms wins over the header.
            assert w.seen[-1].deadline - w.seen[-1].enqueued == pytest.approx(2.5)


async def test_duplicate_and_late_results_are_dropped_and_counted(nats_server) -> None:
    fleet = make_fleet(nats_server.url)
    # At-least-once: every result is sent twice (a redelivered task answered again).
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client, scripted_worker(
            nats_server.url, fleet.queue, behaviour=lambda t: [answer(t), answer(t, vector=b"\0" * 32)]
        ):
            await wait_ready(client)
            r = await client.post("/v1/embeddings", json={"model": BASE, "input": TEXTS})
            assert r.status_code == 200, r.text
            # The first result per slot wins; the all-zero duplicates must not overwrite it.
            for text, d in zip(TEXTS, r.json()["data"], strict=True):
                np.testing.assert_array_equal(np.asarray(d["embedding"], dtype="<f4"), fake_vector(text))
            # The last slot's duplicate arrives after the request completed: it is late, the others duplicates.
            await until(lambda: gw.metric("lorafleet_gateway_dropped_results_total", reason="duplicate")
                        + gw.metric("lorafleet_gateway_dropped_results_total", reason="late") == len(TEXTS))
            assert gw.metric("lorafleet_gateway_dropped_results_total", reason="duplicate") >= 1
            assert gw.gateway.pending.tasks_in_flight() == 0


@pytest.mark.parametrize(
    ("code", "status", "public"),
    [(wire.ERR_ADAPTER, 503, "adapter_unavailable"), (wire.ERR_RUNTIME, 500, "internal_error"),
     (wire.ERR_MALFORMED, 500, "internal_error"), (wire.ERR_DEADLINE, 504, "deadline_exceeded")],
)
async def test_worker_error_codes_map_to_statuses(nats_server, code: str, status: int, public: str) -> None:
    fleet = make_fleet(nats_server.url)

    def fail_second(task: wire.Task) -> list[wire.Result]:
        if task.index == 1:
            return [answer(task, vector=None, dim=0, error_code=code, error_message="boom on purpose")]
        return [answer(task)]

    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client, scripted_worker(
            nats_server.url, fleet.queue, behaviour=fail_second
        ):
            await wait_ready(client)
            r = await client.post("/v1/embeddings", json={"model": BASE, "input": TEXTS})
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert err["code"] == public
            # A stable code and the request's id; the worker's text stays in the gateway's log (issue 38).
            assert "boom on purpose" not in r.text and err["request_id"] == r.headers["X-Request-Id"]
            if status == 503:
                assert r.headers["Retry-After"] == "1"


async def test_a_result_with_a_wrong_sized_vector_fails_the_request(nats_server) -> None:
    fleet = make_fleet(nats_server.url)
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client, scripted_worker(
            nats_server.url, fleet.queue, behaviour=lambda t: [answer(t, vector=b"\0" * 12, dim=8)]
        ):
            await wait_ready(client)
            r = await client.post("/v1/embeddings", json={"model": BASE, "input": "a"})
            assert r.status_code == 500, r.text
            assert r.json()["error"]["code"] == "internal_error" and r.json()["error"]["request_id"]


async def test_metrics_exposes_every_family(nats_server) -> None:
    fleet = make_fleet(nats_server.url)
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client, scripted_worker(nats_server.url, fleet.queue):
            await wait_ready(client)
            assert (await client.post("/v1/embeddings", json={"model": BASE, "input": ["a b", "c"]})).status_code == 200
            assert (await client.post("/v1/embeddings", json={"model": "nope", "input": "a"})).status_code == 404
            r = await client.get("/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            text = r.text
            for family in ("lorafleet_gateway_requests_total", "lorafleet_gateway_request_seconds_bucket",
                           "lorafleet_gateway_queue_wait_seconds_bucket", "lorafleet_gateway_batch_size_bucket",
                           "lorafleet_gateway_tasks_in_flight", "lorafleet_gateway_dropped_results_total",
                           "lorafleet_gateway_tasks_published_total"):
                assert family in text, family
            assert f'lorafleet_gateway_requests_total{{code="200",model="{BASE}",route="embeddings"}} 1.0' in text
            assert 'lorafleet_gateway_requests_total{code="404",model="_invalid",route="embeddings"} 1.0' in text
            assert f'lorafleet_gateway_tasks_published_total{{base="{BASE}"}} 2.0' in text


async def test_concurrent_requests_all_answered(nats_server) -> None:
    import asyncio

    fleet = make_fleet(nats_server.url)
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client, scripted_worker(nats_server.url, fleet.queue):
            await wait_ready(client)
            texts = [f"Satz Nummer {i}" for i in range(64)]
            t0 = time.perf_counter()
            rs = await asyncio.gather(*[client.post("/v1/embeddings", json={"model": BASE, "input": t}) for t in texts])
            assert time.perf_counter() - t0 < 20
            for t, r in zip(texts, rs, strict=True):
                assert r.status_code == 200, r.text
                np.testing.assert_array_equal(np.asarray(r.json()["data"][0]["embedding"], "<f4"), fake_vector(t))
            assert gw.gateway.pending.tasks_in_flight() == 0
