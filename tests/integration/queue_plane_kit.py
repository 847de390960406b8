"""Helpers for the queue-plane tests: a synthetic-runtime cluster, a lean HTTP load, NATS as a given role."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import nats

from lorafleet.core.config import BaseModelSpec, FleetConfig, GatewayConfig, QueueConfig, ServingProfile, WorkerConfig
from lorafleet.ops.cluster import LocalCluster
from lorafleet.testing import wait_until
from lorafleet.tune.loadgen import Connection

BASE = "m"
GENUINE = [1.0] + [0.0] * 7  # what the synthetic runtime returns for every text


def synth_fleet(a_ms: float = 5.0, b_ms: float = 1.0, *, max_items: int = 32, queue: dict[str, Any] | None = None,
                gateway: dict[str, Any] | None = None, worker: dict[str, Any] | None = None) -> FleetConfig:
    """One base on the synthetic runtime: a batch of n costs a + b·n ms (sleeping), so capacity is known."""
    return FleetConfig(
        bases=[BaseModelSpec(name=BASE, runtime="synthetic", options={"a_ms": a_ms, "b_ms": b_ms})],
        gateway=GatewayConfig(**(gateway or {})),
        worker=WorkerConfig(heartbeat_s=0.3, profile=ServingProfile(max_batch_items=max_items, max_wait_ms=2.0),
                            **(worker or {})),
        queue=QueueConfig(**(queue or {})),
    )


def until(cond: Callable[[], bool], timeout: float, what: str, poll_s: float = 0.05) -> float:
    """`wait_until`, returning the seconds it took (the tests print recovery times)."""
    t0 = time.monotonic()
    wait_until(cond, timeout, what, poll_s=poll_s)
    return time.monotonic() - t0


def encode_body(text: str, deadline_ms: float | None = None) -> bytes:
    body: dict[str, Any] = {"inputs": [text]}
    if deadline_ms is not None:
        body["deadline_ms"] = deadline_ms
    return msgpack.packb(body)


@dataclass
class Outcome:
    sent: float  # seconds since the load started (intended send time)
    status: int  # 0: connection failed
    latency_ms: float


@dataclass
class Load:
    """Open-loop single-input requests over raw keep-alive HTTP (light on the two shared cores)."""

    cluster: LocalCluster
    deadline_ms: float | None = None
    outcomes: list[Outcome] = field(default_factory=list)

    async def run(self, rate: float, duration_s: float, drain_s: float = 30.0) -> list[Outcome]:
        host, port = self.cluster.host, self.cluster.port
        idle: list[Connection] = []
        start = time.perf_counter()
        tasks: set[asyncio.Task[None]] = set()

        async def one(i: int, intended: float) -> None:
            conn = idle.pop() if idle else Connection(host, port, f"/v1/encode/{BASE}", "application/msgpack")
            try:
                status = await conn.post(encode_body(f"Satz {i}", self.deadline_ms))
            except Exception:
                status = 0
                conn.close()
            self.outcomes.append(Outcome(intended - start, status, (time.perf_counter() - intended) * 1000.0))
            if status:
                idle.append(conn)

        n = int(rate * duration_s)
        for i in range(n):
            intended = start + i / rate
            delay = intended - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(i, intended))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=drain_s)
        for conn in idle:
            conn.close()
        return self.outcomes


def counts(outcomes: list[Outcome]) -> dict[int, int]:
    out: dict[int, int] = {}
    for o in outcomes:
        out[o.status] = out.get(o.status, 0) + 1
    return dict(sorted(out.items()))


def metric(text: str, name: str, **labels: str) -> float:
    """A sample of a Prometheus text exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name):
            head, _, value = line.rpartition(" ")
            got = head[len(name):]
            inner = ",".join(sorted(got.strip("{}").split(","))) if got else ""
            if inner == want:
                return float(value)
    return 0.0


async def connect_as(cluster: LocalCluster, role: str | None, **kw: Any) -> Any:
    return await nats.connect(cluster.nats_url, allow_reconnect=False, connect_timeout=3,
                              **cluster.client_options(role), **kw)


def worker_totals(log: Path) -> tuple[int, int]:
    """(tasks computed, orphaned tasks dropped) from a worker's last 'stopped' log line."""
    found = re.findall(r"stopped: \d+ batches, (\d+) tasks, [\d.]+s computing; (\d+) tasks of gone gateways",
                       log.read_text(errors="replace"))
    assert found, f"no 'stopped' line in {log}"
    computed, dropped = found[-1]
    return int(computed), int(dropped)
