"""Small defects of issue 12, each against a real gateway on a real nats-server: a 1 ms deadline, a 3 MB
input, broken MessagePack, a non-UTF-8 body, a 100 KB model name, what /readyz shows."""

from __future__ import annotations

import asyncio
import time

import httpx
import msgpack
import pytest
from serve_harness import BASE, make_fleet, running_gateway, scripted_worker, wait_ready

from lorafleet.serve.parsing import parse_encode

pytestmark = pytest.mark.integration


async def test_a_1_ms_deadline_is_a_504_deadline_not_a_503(nats_server) -> None:
    fleet = make_fleet(nats_server.url)
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client, scripted_worker(nats_server.url, fleet.queue):
            await wait_ready(client, serving=True)
            r = await client.post("/v1/embeddings", json={"model": BASE, "input": "x"},
                                  headers={"X-Lorafleet-Deadline-Ms": "1"})
            assert r.status_code == 504, r.text
            assert r.json()["error"]["code"] == "deadline_exceeded" and "1 ms" in r.json()["error"]["message"]


async def test_counting_tokens_of_3_mb_keeps_the_event_loop_free(nats_server) -> None:
    fleet = make_fleet(nats_server.url)
    text = "Der Käufer zahlt den Kaufpreis und nimmt die Sache ab. " * 53_000  # ~3 MB
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            await wait_ready(client)
            big = asyncio.create_task(client.post("/v1/embeddings", json={"model": BASE, "input": text}))
            stalls = []
            while not big.done():
                t0 = time.perf_counter()
                assert (await client.get("/healthz")).status_code == 200
                stalls.append(time.perf_counter() - t0)
                await asyncio.sleep(0.02)
            r = await big
            assert r.status_code == 400 and r.json()["error"]["code"] == "input_too_long"
            assert len(stalls) > 5, "the big request finished too fast to show anything"
            assert max(stalls) < 0.5, f"/healthz stalled {max(stalls):.2f}s while a big input was tokenized"


@pytest.mark.parametrize(("body", "reason"), [
    (b"\x81\xa1a", "truncated"), (b"\xc1", "a byte that starts no MessagePack type"),
    (b"\x01\x02", "extra bytes"), (b"\x91" * 2000, "nested too deeply"), (b"\x81\xa1a\xa2\xff\xfe", "UTF-8"),
    (b"\x82", "truncated")])
def test_messagepack_errors_say_why(body: bytes, reason: str) -> None:
    from lorafleet.serve.errors import ApiError

    with pytest.raises(ApiError) as info:
        parse_encode(body, 10)
    assert info.value.code == "invalid_msgpack" and reason in info.value.message
    assert not info.value.message.endswith(": ")


async def test_bad_bodies_and_huge_names_get_short_clear_errors(nats_server) -> None:
    fleet = make_fleet(nats_server.url)
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client:
            await wait_ready(client)
            r = await client.post("/v1/embeddings", content=b'{"model": "\xff\xfe", "input": "a"}',
                                  headers={"Content-Type": "application/json"})
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "invalid_encoding" and "UTF-8" in err["message"]
            assert "surrogates" not in err["message"] and "str is not valid" not in err["message"]

            name = "m" * 100_000
            r = await client.post("/v1/embeddings", json={"model": name, "input": "a"})
            assert r.status_code == 404 and len(r.content) < 1000 and "(100000 characters)" in r.text
            r = await client.post(f"/v1/encode/{'x' * 50_000}", content=msgpack.packb({"inputs": ["a"]}))
            assert r.status_code == 404 and len(r.content) < 1000

            r = await client.post(f"/v1/encode/{BASE}", content=b"\xc1")
            assert r.status_code == 400 and "a byte that starts no MessagePack type" in r.text

            ready = await client.get("/readyz")  # open to anyone: says whether it serves, not where NATS is
            assert nats_server.url not in ready.text and "127.0.0.1" not in ready.text and "url" not in ready.json()
