"""Every status of the gateway's error contract, over real HTTP with a real nats-server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack
import pytest
import yaml
from serve_harness import BASE, fake_vector, make_fleet, running_gateway, scripted_worker, until, wait_ready

from lorafleet.core.config import BaseModelSpec, ServedModel
from lorafleet.nats.server import NatsServer, free_port

pytestmark = pytest.mark.integration

LONG = "Rechtsverordnung " * 40  # far over max_input_tokens=32 below


def _error(r: httpx.Response, status: int, code: str, *fragments: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == code, err
    for f in fragments:
        assert f in err["message"], (f, err["message"])
    return err


BAD_JSON_BODIES = [
    (b"{not json", "invalid_json", "not valid JSON"),
    (b"", "invalid_json", "body is empty"),
    (b"[1, 2]", "invalid_json", "must be a JSON object"),
    (b'{"input": "x"}', "missing_model", "'model' is missing"),
    (b'{"model": 3, "input": "x"}', "missing_model", "non-empty string"),
    (b'{"model": "all-MiniLM-L6-v2"}', "missing_input", "'input' is missing"),
    (b'{"model": "all-MiniLM-L6-v2", "input": []}', "empty_input", "empty list"),
    (b'{"model": "all-MiniLM-L6-v2", "input": ["a", 5]}', "invalid_input", "input[1] is a number"),
    (b'{"model": "all-MiniLM-L6-v2", "input": [[1, 2]]}', "invalid_input", "token ids are not accepted"),
    (b'{"model": "all-MiniLM-L6-v2", "input": ["a", ""]}', "empty_input", "input[1] is an empty string"),
    (b'{"model": "all-MiniLM-L6-v2", "input": ["a","b","c","d","e"]}', "too_many_inputs", "at most 4"),
    (b'{"model": "all-MiniLM-L6-v2", "input": "a", "encoding_format": "int8"}', "invalid_encoding_format", "int8"),
    (b'{"model": "all-MiniLM-L6-v2", "input": "a", "dimensions": 0}', "invalid_dimensions", "positive integer"),
    (b'{"model": "all-MiniLM-L6-v2", "input": "a", "dimensions": 128}', "unsupported_dimensions", "pass 384"),
]


async def test_400s_name_what_to_fix(nats_server) -> None:
    fleet = make_fleet(nats_server.url, max_inputs=4, max_input_tokens=32)
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client:
            await wait_ready(client)
            for body, code, fragment in BAD_JSON_BODIES:
                r = await client.post("/v1/embeddings", content=body, headers={"Content-Type": "application/json"})
                _error(r, 400, code, fragment)

            r = await client.post("/v1/embeddings", json={"model": BASE, "input": ["short", LONG]})
            _error(r, 400, "input_too_long", "input 1", "max_input_tokens=32")

            r = await client.post("/v1/embeddings", json={"model": BASE, "input": "a"},
                                  headers={"X-Lorafleet-Deadline-Ms": "soon"})
            _error(r, 400, "invalid_deadline", "X-Lorafleet-Deadline-Ms", "'soon'")
            r = await client.post("/v1/embeddings", json={"model": BASE, "input": "a"},
                                  headers={"X-Lorafleet-Deadline-Ms": "-5"})
            _error(r, 400, "invalid_deadline", "positive number")

            enc = f"/v1/encode/{BASE}"
            _error(await client.post(enc, content=b"\xc1\xc1"), 400, "invalid_msgpack", "not valid MessagePack")
            _error(await client.post(enc, content=msgpack.packb([1])), 400, "invalid_msgpack",
                   "must be a MessagePack map")
            _error(await client.post(enc, content=msgpack.packb({"x": 1})), 400, "missing_input", "'inputs' is missing")
            _error(await client.post(enc, content=msgpack.packb({"inputs": ["a", b"raw"]})), 400, "invalid_input",
                   "inputs[1] is bytes")
            _error(await client.post(enc, content=msgpack.packb({"inputs": ["a"], "deadline_ms": 0})), 400,
                   "invalid_deadline", "deadline_ms")
            _error(await client.post(enc, content=msgpack.packb({"inputs": [LONG]})), 400, "input_too_long", "input 0")
            # 405 comes from Starlette's routing, still in the JSON error shape.
            _error(await client.get("/v1/embeddings"), 405, "method_not_allowed")
        # Nothing invalid reached the queue.
        assert gw.metric("lorafleet_gateway_tasks_published_total", base=BASE) == 0


async def test_401_403_and_open_probes(nats_server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAFLEET_API_KEYS", "env-key-1, env-key-2")
    fleet = make_fleet(nats_server.url, api_keys=["cfg-key"])
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client:
            await wait_ready(client)
            body = {"model": BASE, "input": "a"}
            r = _error(await client.post("/v1/embeddings", json=body), 401, "missing_api_key", "Bearer")
            r = await client.post("/v1/embeddings", json=body)
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
            _error(await client.post("/v1/embeddings", json=body, headers={"Authorization": "Basic abc"}), 401,
                   "missing_api_key")
            _error(await client.post("/v1/embeddings", json=body, headers={"Authorization": "Bearer wrong"}), 403,
                   "invalid_api_key")
            _error(await client.get("/v1/models", headers={"Authorization": "Bearer env-key"}), 403, "invalid_api_key")
            _error(await client.post(f"/v1/encode/{BASE}", content=msgpack.packb({"inputs": ["a"]})), 401,
                   "missing_api_key")
            for key in ("cfg-key", "env-key-1", "env-key-2"):
                r = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
            # A valid key gets past auth to the next check (no worker runs here → 503).
            r = await client.post("/v1/embeddings", json=body, headers={"Authorization": "Bearer env-key-2"})
            _error(r, 503, "no_worker")
            for path in ("/healthz", "/metrics"):
                assert (await client.get(path)).status_code == 200, path
            ready = await client.get("/readyz")  # open too; 503: nothing can be served without a worker
            assert ready.status_code == 503 and "url" not in ready.text and nats_server.url not in ready.text


async def test_404_lists_served_names_and_models_route(nats_server) -> None:
    bundle = ServedModel(name="german-legal", base=BASE, adapter="/bundles/gl")
    fleet = make_fleet(nats_server.url, models=[bundle])
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client:
            await wait_ready(client)
            r = await client.post("/v1/embeddings", json={"model": "gpt-embed", "input": "a"})
            _error(r, 404, "model_not_found", "'gpt-embed'", BASE, "german-legal")
            _error(await client.post("/v1/encode/gpt-embed", content=msgpack.packb({"inputs": ["a"]})), 404,
                   "model_not_found", "german-legal")
            models = (await client.get("/v1/models")).json()
            assert models["object"] == "list"
            assert [(m["id"], m["root"], m["adapter"]) for m in models["data"]] == [
                (BASE, BASE, None), ("german-legal", BASE, "german-legal")]

            # The resolver is updatable at runtime (the registry will feed it from the fleet KV bucket).
            gw.gateway.resolver.set_models([ServedModel(name="tax-law", base=BASE, adapter="/bundles/tax")])
            r = await client.post("/v1/embeddings", json={"model": "german-legal", "input": "a"})
            _error(r, 404, "model_not_found", "tax-law")


async def test_413_by_content_length_and_by_streamed_size(nats_server) -> None:
    fleet = make_fleet(nats_server.url, max_body_bytes=1024)
    big = b'{"model": "all-MiniLM-L6-v2", "input": "' + b"a" * 2000 + b'"}'
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client:
            await wait_ready(client)
            r = await client.post("/v1/embeddings", content=big, headers={"Content-Type": "application/json"})
            _error(r, 413, "body_too_large", "max_body_bytes=1024")

            async def chunks():  # no Content-Length: chunked transfer, only the streamed size can tell
                for i in range(0, len(big), 256):
                    yield big[i:i + 256]

            r = await client.post("/v1/embeddings", content=chunks(), headers={"Content-Type": "application/json"})
            assert "content-length" not in {k.lower() for k in r.request.headers}
            _error(r, 413, "body_too_large", "max_body_bytes=1024")
            _error(await client.post(f"/v1/encode/{BASE}", content=b"\x00" * 2048), 413, "body_too_large")


async def test_429_when_the_stream_is_full(nats_server) -> None:
    fleet = make_fleet(nats_server.url, queue={"max_msgs": 2})
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client:
            await wait_ready(client)
            # A live but stalled worker: real heartbeats on the heartbeat subject, but it never pulls,
            # so the stream (max_msgs=2, discard new) fills up.
            async with scripted_worker(nats_server.url, fleet.queue, consume=False):
                # Three inputs cannot fit: refused whole, before any of them is published.
                r = await client.post("/v1/embeddings", json={"model": BASE, "input": ["a", "b", "c"]})
                _error(r, 429, "queue_full", "room for 2", "queue.max_msgs=2", "retry later")
                assert r.headers["Retry-After"] == "1"
                # Two single inputs fill the stream; a third (the one-publish path) is refused by the stream.
                waiting = [asyncio.create_task(client.post(f"/v1/encode/{BASE}", content=msgpack.packb(
                    {"inputs": [x], "deadline_ms": 1500}))) for x in ("a", "b")]
                await until(lambda: gw.gateway.pending.tasks_in_flight() == 2)
                r = await client.post(f"/v1/encode/{BASE}", content=msgpack.packb({"inputs": ["d"]}))
                _error(r, 429, "queue_full", "maximum messages")
                assert r.headers["Retry-After"] == "1"
                assert [w.status_code for w in await asyncio.gather(*waiting)] == [504, 504]
                assert gw.gateway.pending.tasks_in_flight() == 0


async def test_503_without_a_live_worker(nats_server) -> None:
    fleet = make_fleet(nats_server.url, worker_liveness_s=0.5)
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client:
            ready = await wait_ready(client)
            assert ready["workers"] == {BASE: 0}
            r = await client.post("/v1/embeddings", json={"model": BASE, "input": "a"})
            _error(r, 503, "no_worker", f"'{BASE}'", "worker_liveness_s=0.5s")
            assert r.headers["Retry-After"] == "1"
            # A draining worker does not count as serving.
            async with scripted_worker(nats_server.url, fleet.queue, consume=False, draining=True):
                _error(await client.post("/v1/embeddings", json={"model": BASE, "input": "a"}), 503, "no_worker")
            async with scripted_worker(nats_server.url, fleet.queue, consume=False):
                assert (await client.get("/readyz")).json()["workers"] == {BASE: 1}
            # Heartbeats stopped: after worker_liveness_s the base has no worker again.
            await until(lambda: gw.gateway.workers.live_counts([BASE])[BASE] == 0, timeout=3)
            _error(await client.post("/v1/embeddings", json={"model": BASE, "input": "a"}), 503, "no_worker")


async def test_a_scale_to_zero_base_queues_until_a_worker_comes(nats_server) -> None:
    """A base marked scale_to_zero is accepted with no live worker; its task waits in the stream (the lag an
    autoscaler reads) and the first worker that comes answers it within the deadline."""
    fleet = make_fleet(nats_server.url, worker_liveness_s=0.5).model_copy(
        update={"bases": [BaseModelSpec(name=BASE, scale_to_zero=True)]})
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
            ready = await wait_ready(client, serving=True)  # ready without a worker: its tasks can wait
            assert ready["workers"] == {BASE: 0} and ready["bases"][BASE]["scale_to_zero"] is True
            call = asyncio.create_task(client.post("/v1/embeddings", json={"model": BASE, "input": "kalt"},
                                                   headers={"X-Lorafleet-Deadline-Ms": "20000"}))
            await until(lambda: gw.gateway.pending.tasks_in_flight() == 1, timeout=5)
            assert not call.done()
            async with scripted_worker(nats_server.url, fleet.queue):
                r = await call
            assert r.status_code == 200, r.text
            got = r.json()["data"][0]["embedding"]
            assert got == pytest.approx(fake_vector("kalt").tolist())


async def test_504_when_the_deadline_passes(nats_server) -> None:
    fleet = make_fleet(nats_server.url)
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client:
            await wait_ready(client)
            # A live but stalled worker (heartbeats, never pulls): nobody answers the tasks.
            async with scripted_worker(nats_server.url, fleet.queue, consume=False):
                t0 = time.perf_counter()
                r = await client.post("/v1/embeddings", json={"model": BASE, "input": ["a", "b"]},
                                      headers={"X-Lorafleet-Deadline-Ms": "300"})
                elapsed = time.perf_counter() - t0
                _error(r, 504, "deadline_exceeded", "300 ms", "0 of 2")
                assert 0.3 <= elapsed < 2.0
                t0 = time.perf_counter()
                body = msgpack.packb({"inputs": ["a"], "deadline_ms": 200})
                r = await client.post(f"/v1/encode/{BASE}", content=body)
                _error(r, 504, "deadline_exceeded", "200 ms")
                assert 0.2 <= time.perf_counter() - t0 < 2.0
            assert gw.gateway.pending.tasks_in_flight() == 0
            assert gw.metric("lorafleet_gateway_requests_total", route="embeddings", model=BASE, code="504") == 1


async def test_readyz_follows_nats_and_503_while_disconnected(tmp_path: Path) -> None:
    port = free_port()
    fleet = make_fleet(f"nats://127.0.0.1:{port}")
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client:
            assert (await client.get("/healthz")).status_code == 200  # alive without NATS
            r = await client.get("/readyz")
            assert r.status_code == 503
            assert r.json()["nats"]["connected"] is False and r.json()["stream"]["exists"] is False
            r = await client.post("/v1/embeddings", json={"model": BASE, "input": "a"})
            _error(r, 503, "queue_unavailable", "not connected to NATS")
            assert r.headers["Retry-After"] == "1"
            with NatsServer(tmp_path / "nats", port=port):
                ready = await wait_ready(client, timeout=15)
                assert ready["nats"]["connected"] is True and ready["stream"]["exists"] is True
                assert ready["stream"]["name"] == fleet.queue.stream


def test_module_entry_point_serves_and_stops(nats_server, tmp_path: Path) -> None:
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump({"queue": {"storage": "memory"}}))
    port = free_port()
    cmd = [sys.executable, "-m", "lorafleet.serve", "--fleet", str(fleet_file), "--nats-url", nats_server.url,
           "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1)
                if r.json()["stream"]["exists"]:  # up and connected (no worker: 503 until one pulls)
                    assert r.status_code == 503 and r.json()["bases"]["all-MiniLM-L6-v2"]["workers"] == 0
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "gateway not ready in 30 s"
            time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").json()["status"] == "ok"
        os.kill(proc.pid, signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal: "terminated by SIGTERM" is the clean exit.
        assert proc.wait(timeout=15) in (0, -signal.SIGTERM)
        out = proc.stdout.read().decode() if proc.stdout else ""
        assert "Traceback" not in out, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_module_entry_point_rejects_a_bad_fleet(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text("gateway:\n  prot: 80\n")
    r = subprocess.run([sys.executable, "-m", "lorafleet.serve", "--fleet", str(bad)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert "gateway.prot: unknown key" in r.stderr
