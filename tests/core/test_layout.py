"""The NATS layout under the admin credential (lorafleet/ops/layout.py): applied by `lorafleet up`, healed by its
keeper,
the fleet file's bucket sealed. Real nats-server with lorafleet's authorization block."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from lorafleet.core.config import BaseModelSpec, FleetConfig
from lorafleet.core.fleet_state import fetch_fleet_config
from lorafleet.core.wire import FLEET_KV_BUCKET
from lorafleet.nats.auth import ROLES, generate_credentials
from lorafleet.nats.queue import wait_for_stream
from lorafleet.nats.server import NatsServer
from lorafleet.ops.layout import CONFIG_STREAM, LayoutKeeper, apply_layout, fleet_config_sealed

pytestmark = pytest.mark.integration

WAIT_S = 10.0  # upper bound on any awaited event; each arrives well within a second


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    generate_credentials(tmp_path / "creds", ROLES)
    srv = NatsServer(tmp_path / "nats", creds=tmp_path / "creds").start()
    try:
        yield srv
    finally:
        srv.stop()


async def test_the_fleet_file_is_sealed_kept_when_unchanged_and_replaced_when_changed(server: NatsServer) -> None:
    fleet = FleetConfig(bases=[BaseModelSpec(name="mini-base")])
    admin = server.client_options("admin")
    await apply_layout(server.url, admin, fleet)
    nc = await nats.connect(server.url, **admin)
    try:
        js = nc.jetstream()
        first = await js.stream_info(CONFIG_STREAM)
        assert first.config.sealed
        await apply_layout(server.url, admin, fleet)  # `up` again, same file: the same bucket
        assert (await js.stream_info(CONFIG_STREAM)).created == first.created
        changed = FleetConfig(bases=[BaseModelSpec(name="mini-base"), BaseModelSpec(name="other-base")])
        await apply_layout(server.url, admin, changed)  # a sealed stream cannot take the new file: made again
        again = await js.stream_info(CONFIG_STREAM)
        assert again.config.sealed and again.state.messages == 1
    finally:
        await nc.close()
    got = await asyncio.to_thread(fetch_fleet_config, server.url, server.client_options("worker"))
    assert [b.name for b in got.bases] == ["mini-base", "other-base"]


async def test_the_keeper_recreates_every_lost_part_with_admin(server: NatsServer) -> None:
    """Two keepers at once (a Deployment's rollout overlaps old and new pod) heal the same losses in parallel."""
    fleet = FleetConfig(bases=[BaseModelSpec(name="mini-base")])
    await apply_layout(server.url, server.client_options("admin"), fleet)
    events: list[str] = []
    keepers = [LayoutKeeper(server.url, server.client_options("admin"), fleet, check_s=60.0,
                            on_event=events.append).start() for _ in range(2)]  # the deletion advisory wakes them
    nc = await nats.connect(server.url, **server.client_options("admin"))
    try:
        js = nc.jetstream()
        lost = [fleet.queue.stream, fleet.queue.dlq_stream, f"KV_{FLEET_KV_BUCKET}", CONFIG_STREAM]
        for name in lost:
            await js.delete_stream(name)
        for name in lost:
            await asyncio.wait_for(wait_for_stream(js, name, poll_s=0.05), WAIT_S)
        assert (await js.stream_info(fleet.queue.stream)).config.subjects == ["lorafleet.work.mini-base"]

        async def sealed_with_the_file() -> None:  # the stream may exist a moment before the file is in and sealed
            while not await fleet_config_sealed(js, fleet):
                await asyncio.sleep(0.05)

        await asyncio.wait_for(sealed_with_the_file(), WAIT_S)
        got = await asyncio.to_thread(fetch_fleet_config, server.url, server.client_options("worker"))
        assert [b.name for b in got.bases] == ["mini-base"]
    finally:
        await nc.close()
        for keeper in keepers:
            await asyncio.to_thread(keeper.stop)
    assert sum(k.healed for k in keepers) >= len(lost) and events and all("re-created" in e for e in events)
