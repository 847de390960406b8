"""Helpers for gateway tests: a real gateway (uvicorn, in-process thread) and a scripted worker on real NATS."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import nats
import numpy as np
import uvicorn

from lorafleet.core import wire
from lorafleet.core.config import FleetConfig, GatewayConfig, QueueConfig, ServedModel
from lorafleet.nats.queue import ensure_consumer, ensure_streams
from lorafleet.nats.server import free_port
from lorafleet.serve.gateway import Gateway
from lorafleet.serve.routes import create_app, uvicorn_config
from lorafleet.testing import wait_until_async

BASE = "all-MiniLM-L6-v2"


def make_fleet(nats_url: str, *, models: list[ServedModel] | None = None, queue: dict[str, Any] | None = None,
               **gateway: Any) -> FleetConfig:
    gw = {"worker_liveness_s": 5.0, **gateway}
    return FleetConfig(nats_url=nats_url, models=models or [], gateway=GatewayConfig(**gw),
                       queue=QueueConfig(**{"storage": "memory", **(queue or {})}))


@dataclass
class RunningGateway:
    url: str
    gateway: Gateway
    server: uvicorn.Server
    thread: threading.Thread

    def metric(self, name: str, **labels: str) -> float:
        value = self.gateway.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@contextlib.contextmanager
def running_gateway(fleet: FleetConfig, nats_url: str | None = None) -> Iterator[RunningGateway]:
    """Serve create_app(fleet) with uvicorn (uvloop + httptools) on a free port, in a thread."""
    app = create_app(fleet, nats_url=nats_url)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port))
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("gateway did not start")
        time.sleep(0.02)
    try:
        yield RunningGateway(url, app.state.gateway, server, thread)
    finally:
        server.should_exit = True
        thread.join(timeout=15)


async def wait_ready(client: httpx.AsyncClient, timeout: float = 10.0, *, serving: bool = False) -> dict[str, Any]:
    """Until the gateway is connected and its stream exists; with `serving`, until /readyz says 200 (every base
    has its consumer and a live worker)."""
    deadline = time.monotonic() + timeout
    while True:
        r = await client.get("/readyz")
        body = r.json()
        if r.status_code == 200 or (not serving and body["nats"]["connected"] and body["stream"]["exists"]):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"gateway not ready: {r.status_code} {r.text}")
        await asyncio.sleep(0.05)


def fake_vector(text: str, dim: int = 8) -> np.ndarray:
    """A vector the scripted worker derives from the text, so tests can check order and encoding."""
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
    return np.random.default_rng(seed).standard_normal(dim).astype("<f4")


Behaviour = Callable[[wire.Task], list[wire.Result]]


def answer(task: wire.Task, **kw: Any) -> wire.Result:
    vec = fake_vector(task.text)
    base = {"task_id": task.id, "index": task.index, "worker": "scripted", "vector": vec.tobytes(),
            "dim": vec.size, "queue_ms": 3.0, "batch_size": 4}
    return wire.Result(**{**base, **kw})


@dataclass
class ScriptedWorker:
    """Stands in for a sidecar worker on the real queue: heartbeats, and optionally pulls and replies.

    consume=False is a live but stalled worker (heartbeats, never pulls): tasks stay in the stream.
    """

    nc: Any
    base: str = BASE
    consume: bool = True
    behaviour: Behaviour = field(default=lambda t: [answer(t)])
    reverse: bool = True  # reply to a fetched batch in reverse order, to check the gateway reorders
    draining: bool = False
    seen: list[wire.Task] = field(default_factory=list)
    stopped: bool = False

    def heartbeat(self) -> bytes:
        return wire.Heartbeat(worker="scripted-1", bases=[self.base], adapters={self.base: []}, in_flight=0,
                              batches_per_s=0.0, tasks_done=0, pid=os.getpid(), host="test",
                              draining=self.draining).to_wire()

    async def run_heartbeats(self) -> None:
        while not self.stopped:
            await self.nc.publish(wire.heartbeat_subject("scripted-1"), self.heartbeat())
            await asyncio.sleep(0.2)

    async def run_pull(self, queue: QueueConfig) -> None:
        js = self.nc.jetstream()
        await ensure_streams(js, queue)
        durable = await ensure_consumer(js, self.base, queue)
        sub = await js.pull_subscribe_bind(durable, queue.stream)
        while not self.stopped:
            try:
                msgs = await sub.fetch(16, timeout=0.05)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            tasks = [wire.Task.from_wire(m.data) for m in msgs]
            self.seen.extend(tasks)
            for task in reversed(tasks) if self.reverse else tasks:
                for result in self.behaviour(task):
                    await self.nc.publish(task.reply, result.to_wire())
            for m in msgs:
                await m.ack()


@contextlib.asynccontextmanager
async def scripted_worker(nats_url: str, queue: QueueConfig, **kw: Any) -> AsyncIterator[ScriptedWorker]:
    nc = await nats.connect(nats_url)
    worker = ScriptedWorker(nc, **kw)
    jobs: list[asyncio.Task[None]] = [asyncio.create_task(worker.run_heartbeats())]
    if worker.consume:
        jobs.append(asyncio.create_task(worker.run_pull(queue)))
    await asyncio.sleep(0.3)  # let the gateway see a heartbeat
    try:
        yield worker
    finally:
        # A flag as well as cancel(): nats-py's fetch can swallow a cancellation (wait_for race on 3.11).
        worker.stopped = True
        for job in jobs:
            job.cancel()
        await asyncio.wait(jobs, timeout=5)
        await nc.close()


async def until(cond: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0) -> None:
    await wait_until_async(cond, timeout, "condition", poll_s=0.02)
