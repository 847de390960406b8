"""A worker's error text never reaches a client (issue 38, item 7), over real HTTP and a real nats-server.

Scripted workers (serve_harness) fail tasks the way a sidecar reports a failure, with the texts real failures
carry: an out-of-memory error from torch's allocator, an adapter's path on the worker's disk. Every route (OpenAI
embeddings, chat and completions whole and streamed, the rerank routes) answers with a stable code and the
request's id (body and X-Request-Id) and none of that text; the gateway's log has it under the same id. A runtime's
refusal of the client's own input (invalid_request, 400) still says what to change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgpack
import nats
import orjson
import pytest
from serve_harness import BASE, ScriptedWorker, answer, running_gateway, wait_ready

from lorafleet.core import wire
from lorafleet.core.config import PACKAGED_MINILM, BaseModelSpec, FleetConfig, GatewayConfig, QueueConfig, ServedModel

pytestmark = pytest.mark.integration

CE, LLM = "minilm-ce", "tiny-llama"  # a rerank base (its specialist ce-legal reranks), a generative one
OOM = ("MemoryError: [enforce fail at alloc_cpu.cpp:116] data. DefaultCPUAllocator: not enough memory: you tried "
       "to allocate 1073741824 bytes.")
NO_DIR = "adapter directory /srv/lorafleet/home/bundles/legal/7/adapter does not exist"
INTERNAL = ("MemoryError", "alloc_cpu", "DefaultCPUAllocator", "/srv/lorafleet", "bundles/legal", "does not exist")
REFUSED = "the prompt has 600 tokens; the context of tiny-llama is 512"


@dataclass
class NamedWorker(ScriptedWorker):
    """A scripted worker of one base whose heartbeats carry its own name (several run side by side)."""

    name: str = "scripted-1"

    def heartbeat(self) -> bytes:
        return wire.Heartbeat(worker=self.name, bases=[self.base], adapters={self.base: []}, in_flight=0,
                              batches_per_s=0.0, tasks_done=0, pid=1, host="test").to_wire()

    async def run_heartbeats(self) -> None:
        while not self.stopped:
            await self.nc.publish(wire.heartbeat_subject(self.name), self.heartbeat())
            await asyncio.sleep(0.2)


def failing(task: wire.Task) -> list[wire.Result]:
    """What a sidecar sends for the failures under test; everything else succeeds."""
    def error(code: str, message: str) -> list[wire.Result]:
        return [answer(task, vector=None, dim=0, error_code=code, error_message=message)]

    if task.adapter == "legal@7":
        return error(wire.ERR_ADAPTER, NO_DIR)
    if task.op == wire.GENERATE:
        params = wire.GenerateParams.of(task)
        if "refuse" in task.text:
            return error(wire.ERR_INVALID, REFUSED)
        if params.stream:  # some text first, then the failure: the error event comes mid-stream
            return [answer(task, vector=None, dim=0, text="Hel", seq=0, attempt=1), *error(wire.ERR_RUNTIME, OOM)]
        return error(wire.ERR_RUNTIME, OOM)
    if task.op == wire.SCORE or task.index == 1:
        return error(wire.ERR_RUNTIME, OOM)
    return [answer(task)]


@contextlib.asynccontextmanager
async def workers(url: str, queue: QueueConfig) -> AsyncIterator[list[NamedWorker]]:
    conns = [await nats.connect(url) for _ in range(3)]
    crew = [NamedWorker(nc, base=b, behaviour=failing, name=f"scripted-{b}") for nc, b in zip(conns, (BASE, CE, LLM),
                                                                                              strict=True)]
    jobs = [asyncio.create_task(job) for w in crew for job in (w.run_heartbeats(), w.run_pull(queue))]
    try:
        yield crew
    finally:
        for w in crew:
            w.stopped = True
        for job in jobs:
            job.cancel()
        await asyncio.wait(jobs, timeout=5)
        for nc in conns:
            await nc.close()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorafleet.testing import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("llm") / "base")


@pytest.fixture
def fleet(nats_server, tiny_llama: Path) -> Iterator[FleetConfig]:
    yield FleetConfig(
        nats_url=nats_server.url,
        bases=[BaseModelSpec(name=BASE), BaseModelSpec(name=CE, source=PACKAGED_MINILM, runtime="cross-encoder"),
               BaseModelSpec(name=LLM, source=str(tiny_llama), runtime="transformers")],
        models=[ServedModel(name="legal", base=BASE, adapter="/srv/lorafleet/home/bundles/legal/7/adapter",
                            adapter_id="legal@7"),
                ServedModel(name="ce-legal", base=CE, adapter="/bundles/ce-legal/adapter", adapter_id="ce-legal@1")],
        gateway=GatewayConfig(worker_liveness_s=5.0), queue=QueueConfig(storage="memory"))


def _clean(r: httpx.Response, status: int, code: str) -> str:
    """The error answer: its code, a request id in body and header, no internal text; returns the id."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    assert not any(bit in r.text for bit in INTERNAL), r.text
    request_id = err["request_id"]
    assert request_id and r.headers["X-Request-Id"] == request_id and request_id in err["message"], r.text
    return request_id


async def test_worker_errors_reach_clients_as_a_code_and_a_request_id(
        fleet: FleetConfig, caplog: pytest.LogCaptureFixture) -> None:
    with running_gateway(fleet) as gw, caplog.at_level(logging.INFO, logger="lorafleet.serve"):
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client, workers(fleet.nats_url, fleet.queue):
            await wait_ready(client, serving=True)
            ids: dict[str, str] = {}
            r = await client.post("/v1/embeddings", json={"model": BASE, "input": ["a", "b", "c"]})
            ids["embeddings"] = _clean(r, 500, "internal_error")
            r = await client.post("/v1/encode/legal", content=msgpack.packb({"inputs": ["a"]}))
            ids["adapter"] = _clean(r, 503, "adapter_unavailable")
            assert r.headers["Retry-After"]
            for path, body in (("/v1/rerank", {"model": "ce-legal", "query": "q", "documents": ["d1", "d2"]}),
                               ("/rerank", {"query": "q", "texts": ["d1"]})):
                ids[path] = _clean(await client.post(path, json=body), 500, "internal_error")
            r = await client.post("/v1/score/ce-legal", content=msgpack.packb({"query": "q", "documents": ["d"]}))
            ids["score"] = _clean(r, 500, "internal_error")
            chat = {"model": LLM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            ids["chat"] = _clean(await client.post("/v1/chat/completions", json=chat), 500, "internal_error")
            ids["completions"] = _clean(await client.post("/v1/completions", json={"model": LLM, "prompt": "hi"}),
                                        500, "internal_error")

            r = await client.post("/v1/chat/completions", json={**chat, "stream": True})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [orjson.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            assert events[-1]["error"]["code"] == "internal_error", r.text  # the error event, after the text
            assert any(e.get("choices", [{}])[0].get("delta", {}).get("content") == "Hel" for e in events[:-1])
            assert not any(bit in r.text for bit in INTERNAL), r.text
            ids["stream"] = events[-1]["error"]["request_id"]
            assert ids["stream"] == r.headers["X-Request-Id"] and ids["stream"] in events[-1]["error"]["message"]

            # The client's own input, refused by the runtime: that message is for the client.
            r = await client.post("/v1/completions", json={"model": LLM, "prompt": "refuse me"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
            assert REFUSED in r.json()["error"]["message"] and r.json()["error"]["request_id"]
        assert gw.metric("lorafleet_gateway_requests_total", route="chat", model=LLM, code="500") == 2  # whole, stream

    logged = {rec.getMessage() for rec in caplog.records if rec.name == "lorafleet.serve"}
    for what, request_id in ids.items():  # the operator's side: the worker's text under the client's request id
        detail = NO_DIR if what == "adapter" else OOM
        assert any(request_id in line and detail in line for line in logged), (what, request_id, logged)
