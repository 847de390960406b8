"""What nkey auth + TLS cost on the queue plane: the same operations against a plain and a secured server.

    python -m lorafleet.bench.nats_auth_latency [--iterations 3000]

Three nats-servers run side by side (file store, loopback): one open, one with lorafleet's roles,
one with the roles and a self-signed TLS certificate. Blocks of each operation alternate between the two, so drift on a
shared machine hits both alike. Operations: connect (+ nkey handshake + TLS), a JetStream publish
and its ack (the gateway's per-task cost), a core request/reply with a 384-dim vector (a worker's
result and the gateway's receipt), and publish throughput with 64 in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

from lorafleet.core.config import QueueConfig
from lorafleet.core.wire import work_subject
from lorafleet.nats.auth import gateway_inbox_prefix
from lorafleet.nats.queue import ensure_streams
from lorafleet.nats.server import NatsServer
from lorafleet.nats.tls import issue_certificate, make_self_signed_ca
from lorafleet.testing import flush_nats

VECTOR = b"\0" * (384 * 4)
TASK = b"x" * 600  # a task body: text of ~100 tokens plus the MessagePack envelope
BLOCK = 250
BURST = 4000  # publishes per throughput sample


async def _quiet(exc: Exception) -> None:
    """nats-py reports an SSL close-notify race on close() of a TLS connection; it is harmless here."""


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


class Side:
    def __init__(self, label: str, server: NatsServer, secure: bool) -> None:
        self.label, self.server, self.secure = label, server, secure
        self.samples: dict[str, list[float]] = {"connect": [], "js_publish_ack": [], "request_reply": []}
        self.throughput: list[float] = []

    def opts(self, role: str) -> dict[str, Any]:
        return self.server.client_options(role) if self.secure else {}

    async def open(self) -> None:
        admin = await nats.connect(self.server.url, **self.opts("admin"))
        await ensure_streams(admin.jetstream(), QueueConfig())
        await admin.close()
        self.gw = await nats.connect(self.server.url, **self.opts("gateway"))
        self.worker = await nats.connect(self.server.url, **self.opts("worker"))
        self.js = self.gw.jetstream()
        creds = self.server.creds("gateway") if self.secure else None
        self.inbox = gateway_inbox_prefix("bench", creds)

        async def receipt(msg: Any) -> None:
            await self.gw.publish(msg.reply, b"")

        await self.gw.subscribe(f"{self.inbox}.>", cb=receipt)
        await flush_nats(self.gw)  # nats-py's single flush can overtake the buffered SUB

    async def close(self) -> None:
        await self.gw.close()
        await self.worker.close()

    async def run_block(self, n: int) -> None:
        for _ in range(max(n // 25, 1)):
            t = time.perf_counter()
            nc = await nats.connect(self.server.url, **self.opts("worker"), error_cb=_quiet)
            self.samples["connect"].append(time.perf_counter() - t)
            await nc.close()
        subject = work_subject("bench")
        for _ in range(n):
            t = time.perf_counter()
            await self.js.publish(subject, TASK)
            self.samples["js_publish_ack"].append(time.perf_counter() - t)
        for i in range(n):
            t = time.perf_counter()
            await self.worker.request(f"{self.inbox}.r{i}", VECTOR, timeout=5)
            self.samples["request_reply"].append(time.perf_counter() - t)
        sem = asyncio.Semaphore(64)

        async def one() -> None:
            async with sem:
                await self.js.publish(subject, TASK)

        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(BURST)))
        self.throughput.append(BURST / (time.perf_counter() - t))


async def main(iterations: int) -> None:
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        ca = make_self_signed_ca(tmp / "tls")
        cert = issue_certificate(ca, tmp / "tls", "server")
        servers = [NatsServer(tmp / "plain").start(), NatsServer(tmp / "auth", creds=tmp / "creds").start(),
                   NatsServer(tmp / "secure", creds=tmp / "creds", tls=cert).start()]
        sides = [Side("plain", servers[0], False), Side("auth", servers[1], True), Side("auth+TLS", servers[2], True)]
        try:
            for s in sides:
                await s.open()
            for s in sides:  # warm-up
                await s.run_block(50)
                for v in s.samples.values():
                    v.clear()
                s.throughput.clear()
            done = 0
            while done < iterations:
                for s in sides:
                    await s.run_block(BLOCK)
                done += BLOCK
            for s in sides:
                await s.close()
        finally:
            for server in servers:
                server.stop()
    print(f"{'operation':<18} {'side':<9} {'n':>6} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for op in sides[0].samples:
        for s in sides:
            v = s.samples[op]
            print(f"{op:<18} {s.label:<9} {len(v):>6} {_pct(v, .5) * 1e3:>8.3f} {_pct(v, .99) * 1e3:>8.3f} "
                  f"{statistics.fmean(v) * 1e3:>8.3f}")
    for s in sides:
        print(f"js publish throughput, 64 in flight, {s.label}: {statistics.median(s.throughput):,.0f} msg/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--uvloop", action="store_true", help="the event loop the gateway runs on (uvicorn)")
    args = parser.parse_args()
    logging.getLogger("asyncio").setLevel(logging.ERROR)  # "returning true from eof_received()" on TLS close
    if args.uvloop:
        import uvloop

        uvloop.run(main(args.iterations))
    else:
        asyncio.run(main(args.iterations))
