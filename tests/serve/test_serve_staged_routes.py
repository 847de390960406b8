"""Staged preload entries (`lorafleet promote`, issue 16) are invisible to a gateway's routing: a real gateway
on a real nats-server never routes by `_preload.NAME`, while a worker's watcher is handed the entry."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from serve_harness import BASE, make_fleet, running_gateway

from lorafleet.core.fleet_state import (
    FleetEntry,
    FleetWatcher,
    ensure_fleet_bucket,
    preload_key,
    put_entry,
    put_staged,
    read_entries,
)


def _entry(name: str, version: str) -> FleetEntry:
    return FleetEntry(name=name, base=BASE, adapter_id=f"{name}@v{version}", adapter_uri=f"models:/{name}/{version}",
                      version=version, registered_model=name, action="promote")


@pytest.mark.integration
async def test_staged_entry_is_invisible_to_gateway_routing(nats_server) -> None:
    """A real gateway on a real nats-server: a staged entry never becomes a route; workers' watchers get it."""
    import nats

    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        kv = await ensure_fleet_bucket(js)
        staged: list[FleetEntry] = []
        tables: asyncio.Queue[dict[str, FleetEntry]] = asyncio.Queue()
        watcher = FleetWatcher(js, tables.put_nowait, on_staged=staged.append)
        await watcher.start()
        await watcher.wait_initialised(5)
        with running_gateway(make_fleet(nats_server.url)) as gw:
            async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
                await put_staged(kv, _entry("legal", "2"))
                await put_entry(kv, _entry("tax", "1"))  # written after: once it routes, the staged one was seen
                for _ in range(250):
                    names = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
                    if "tax" in names:
                        break
                    await asyncio.sleep(0.02)
                assert "tax" in names and "legal" not in names and preload_key("legal") not in names, names
                r = await client.post("/v1/embeddings", json={"model": "legal", "input": "x"})
                assert r.status_code == 404, r.text
        table = await asyncio.wait_for(tables.get(), 5)
        while "tax" not in table:
            table = await asyncio.wait_for(tables.get(), 5)
        assert set(table) == {"tax"}
        assert [e.adapter_id for e in staged] == ["legal@v2"]
        assert set(await read_entries(kv)) == {"tax"}
        await watcher.stop()
    finally:
        await nc.close()
