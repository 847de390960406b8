"""Issue 23 against a real gateway on a real nats-server: a black-holed server turns /readyz red within the
ping window, a multi-input request that does not fit the stream leaves nothing in it, and a 500 names a
request id instead of the exception."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import httpx
import nats
import pytest
from serve_harness import BASE, make_fleet, running_gateway, scripted_worker, until, wait_ready

from lorafleet.core import wire
from lorafleet.nats.client import stale_after_s
from lorafleet.nats.server import NatsServer

pytestmark = pytest.mark.integration


async def _stream_messages(url: str, stream: str) -> int:
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().stream_info(stream)).state.messages
    finally:
        await nc.close()


async def test_readyz_goes_red_within_the_ping_window_when_the_server_stops_answering(tmp_path: Path) -> None:
    """SIGSTOP: the TCP connection stays open and nothing resets it, as with a lost host or a dropped route.
    Only client pings can tell; /readyz must say so within their window, not after minutes."""
    server = NatsServer(tmp_path / "nats").start()
    fleet = make_fleet(server.url)
    stopped = False
    try:
        with running_gateway(fleet) as gw:
            async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
                await wait_ready(client)
                assert server.pid is not None
                os.kill(server.pid, signal.SIGSTOP)
                stopped = True
                t0 = time.monotonic()

                async def red() -> bool:
                    r = await client.get("/readyz")
                    return r.status_code == 503 and r.json()["nats"]["connected"] is False

                await until(red, timeout=stale_after_s() + 3.0)
                assert time.monotonic() - t0 <= stale_after_s() + 3.0
                os.kill(server.pid, signal.SIGCONT)
                stopped = False
                # The server answers again: the client reconnects by itself and /readyz follows.
                await wait_ready(client, timeout=20)
    finally:
        if stopped and server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


async def test_a_request_that_does_not_fit_the_stream_is_refused_whole(nats_server) -> None:
    """Admission against the stream's room: 3 of max_msgs=4 are queued, so a request of 2 is refused before
    anything of it is published (before: the first went in, the second was refused, and the stream kept a
    task computed for nobody)."""
    fleet = make_fleet(nats_server.url, queue={"max_msgs": 4})
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
            await wait_ready(client)
            async with scripted_worker(nats_server.url, fleet.queue, consume=False):  # live, never pulls
                first = asyncio.create_task(client.post("/v1/embeddings", json={"model": BASE,
                                                                                "input": ["a", "b", "c"]},
                                                        headers={"X-Lorafleet-Deadline-Ms": "3000"}))
                await until(lambda: gw.gateway.pending.tasks_in_flight() == 3)
                assert await _stream_messages(nats_server.url, fleet.queue.stream) == 3
                r = await client.post("/v1/embeddings", json={"model": BASE, "input": ["d", "e"]})
                assert r.status_code == 429, r.text
                assert r.json()["error"]["code"] == "queue_full" and r.headers["Retry-After"]
                assert await _stream_messages(nats_server.url, fleet.queue.stream) == 3
                assert (await first).status_code == 504


async def test_what_was_published_of_a_refused_request_is_taken_back(nats_server) -> None:
    """The gateway cannot see everything (another publisher filled the stream since its last read): the
    request goes out, one task is refused, and the one that went in is deleted before any worker takes it."""
    fleet = make_fleet(nats_server.url, queue={"max_msgs": 4})
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
            await wait_ready(client)
            async with scripted_worker(nats_server.url, fleet.queue, consume=False):
                nc = await nats.connect(nats_server.url)
                try:
                    js = nc.jetstream()
                    for i in range(3):  # behind the gateway's back
                        await js.publish(wire.work_subject(BASE), b"other", headers={wire.HDR_MSG_ID: f"other-{i}"})
                finally:
                    await nc.close()
                r = await client.post("/v1/embeddings", json={"model": BASE, "input": ["d", "e"]})
                assert r.status_code == 429, r.text
                assert r.json()["error"]["code"] == "queue_full"
                assert await _stream_messages(nats_server.url, fleet.queue.stream) == 3
                assert gw.gateway.pending.tasks_in_flight() == 0


async def test_a_500_names_a_request_id_not_the_exception(nats_server, caplog: pytest.LogCaptureFixture) -> None:
    fleet = make_fleet(nats_server.url)
    with running_gateway(fleet) as gw:
        async def broken(*args: object, **kwargs: object) -> object:
            raise RuntimeError("secret detail: /srv/lorafleet/keys at 0xdeadbeef")

        gw.gateway.embed = broken  # type: ignore[method-assign]
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
            with caplog.at_level(logging.ERROR, logger="lorafleet.serve"):
                r = await client.post("/v1/embeddings", json={"model": BASE, "input": "a"})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "internal_error"
    assert "secret" not in r.text and "RuntimeError" not in r.text and "0xdeadbeef" not in r.text
    request_id = err["request_id"]
    assert request_id and request_id in err["message"] and r.headers["X-Request-Id"] == request_id
    logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert logged and logged[0].exc_info is not None and "secret detail" in str(logged[0].exc_info[1])
