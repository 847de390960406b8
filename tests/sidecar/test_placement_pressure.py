"""Queue pressure read from a real nats-server with authentication on, with the worker's own credential."""

from __future__ import annotations

from pathlib import Path

import nats

from lorafleet.core.config import QueueConfig
from lorafleet.core.wire import work_subject
from lorafleet.nats.queue import ensure_consumer, ensure_streams
from lorafleet.nats.server import NatsServer
from lorafleet.sidecar.pressure import read_pressure

QUEUE = QueueConfig(storage="memory")


async def test_waiting_in_flight_and_the_oldest_age_per_base_as_a_worker_sees_them(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats", creds=tmp_path / "creds").start()
    try:
        admin = await nats.connect(server.url, **server.client_options("admin"), allow_reconnect=False)
        worker = await nats.connect(server.url, **server.client_options("worker"), allow_reconnect=False)
        ajs, wjs = admin.jetstream(), worker.jetstream()
        await ensure_streams(ajs, QUEUE, bases=["held", "cold", "quiet"], max_age_s=60.0, update=True)
        await ensure_consumer(wjs, "held", QUEUE)
        first = await ajs.publish(work_subject("held"), b"1")
        for payload in (b"2", b"3"):
            await ajs.publish(work_subject("held"), payload)
        await ajs.publish(work_subject("cold"), b"c")  # nobody holds 'cold': it has no consumer yet

        sub = await wjs.pull_subscribe_bind(durable="workers-held", stream=QUEUE.stream)
        [taken] = await sub.fetch(1, timeout=5)  # the oldest is now in flight, not waiting
        assert taken.metadata.sequence.stream == first.seq

        p = await read_pressure(wjs, QUEUE.stream, ["held", "cold", "quiet"])
        assert (p["held"].waiting, p["held"].in_flight) == (2, 1)
        assert (p["cold"].waiting, p["cold"].in_flight) == (1, 0)
        assert p["quiet"].waiting == 0 and p["quiet"].oldest_wait_s == 0.0
        assert 0.0 <= p["held"].oldest_wait_s < 30.0 and 0.0 <= p["cold"].oldest_wait_s < 30.0
        await worker.close()
        await admin.close()
    finally:
        server.stop()
