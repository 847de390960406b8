"""The gateway's queue monitor when the work stream is lost (issue 38): with a credential it waits for admin's
layout keeper to make the stream again, and sees that it did by the new stream's creation time. Real nats-server."""

from __future__ import annotations

from typing import Any

import nats
import pytest

from lorafleet.core.config import BaseModelSpec, FleetConfig
from lorafleet.nats.queue import ensure_fleet_streams, stream_exists
from lorafleet.serve.queue_monitor import QueueMonitor

pytestmark = pytest.mark.integration

FLEET = FleetConfig(bases=[BaseModelSpec(name="mini-base")])


async def test_a_lost_stream_is_waited_for_and_its_return_seen(nats_server: Any) -> None:
    nc = await nats.connect(nats_server.url, allow_reconnect=False)
    try:
        js = nc.jetstream()
        await ensure_fleet_streams(js, FLEET, update=True)
        rewatched: list[int] = []

        async def on_recreated() -> None:  # the gateway re-watches the fleet bucket here
            rewatched.append(1)

        monitor = QueueMonitor(FLEET, ("mini-base",), lambda base: 0, on_recreated)  # a gateway with a credential
        await monitor.read(js)
        assert monitor.stream_exists and monitor.recreated == 0

        await js.delete_stream(FLEET.queue.stream)
        await monitor.read(js)
        assert not monitor.stream_exists and not await stream_exists(js, FLEET.queue.stream)  # waits, creates nothing
        await ensure_fleet_streams(js, FLEET)  # admin's layout keeper
        await monitor.read(js)
        assert monitor.stream_exists and monitor.recreated == 1 and rewatched == [1]

        # Lost and made again between two reads, never seen missing: the new creation time tells.
        await js.delete_stream(FLEET.queue.stream)
        await ensure_fleet_streams(js, FLEET)
        await monitor.read(js)
        assert monitor.recreated == 2 and rewatched == [1, 1]
        await monitor.read(js)
        assert monitor.recreated == 2  # the same stream again: nothing to redo

        # On a server without authentication the gateway creates a missing stream itself.
        await js.delete_stream(FLEET.queue.stream)
        open_monitor = QueueMonitor(FLEET, ("mini-base",), lambda base: 0, create_missing=True)
        await open_monitor.read(js)
        assert open_monitor.stream_exists and await stream_exists(js, FLEET.queue.stream)
    finally:
        await nc.close()
