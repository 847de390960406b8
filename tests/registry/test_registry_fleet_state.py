"""The fleet KV bucket on a real nats-server: entries, the watcher's view of changes, and merging routes."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.core.config import ServedModel, ServingProfile
from lorafleet.core.fleet_state import (
    FleetEntry,
    FleetWatcher,
    by_adapter_id,
    delete_entry,
    ensure_fleet_bucket,
    merge_models,
    put_entry,
    read_entries,
)


def _entry(name: str, version: str, base: str = "mini") -> FleetEntry:
    return FleetEntry(name=name, base=base, adapter_id=f"{name}@v{version}", adapter_uri=f"models:/{name}/{version}",
                      profile=ServingProfile(max_batch_items=int(version)), version=version, registered_model=name)


def test_merge_and_by_adapter_id() -> None:
    static = [ServedModel(name="legal", base="mini", adapter="/a"),
              ServedModel(name="other", base="mini", adapter="/b")]
    merged = merge_models(static, [_entry("legal", "3"), _entry("ghost", "1", base="unknown")], ["mini"])
    assert [(m.name, m.adapter, m.resolved_adapter_id) for m in merged] == [
        ("other", "/b", "other"), ("legal", "models:/legal/3", "legal@v3")]
    assert by_adapter_id([_entry("legal", "3")])["legal@v3"].profile.max_batch_items == 3  # type: ignore[union-attr]
    entry = _entry("legal", "2")
    assert FleetEntry.from_bytes(entry.to_bytes()) == entry


@pytest.mark.integration
async def test_watcher_sees_initial_state_and_changes(nats_server) -> None:
    import nats

    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        kv = await ensure_fleet_bucket(js)
        assert await ensure_fleet_bucket(js) is not None  # idempotent
        await put_entry(kv, _entry("legal", "1"))
        seen: list[dict[str, FleetEntry]] = []
        watcher = FleetWatcher(js, seen.append)
        await watcher.start()
        await watcher.wait_initialised(5)
        assert [set(t) for t in seen] == [{"legal"}]

        async def until(check) -> None:  # type: ignore[no-untyped-def]
            for _ in range(100):
                if seen and check(seen[-1]):
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"watcher never saw the change; last {seen[-1] if seen else None}")

        await put_entry(kv, _entry("legal", "2"))
        await until(lambda t: t["legal"].version == "2")
        await put_entry(kv, _entry("tax", "1"))
        await until(lambda t: set(t) == {"legal", "tax"})
        await kv.put("broken", b"not json")  # ignored, the watch goes on
        await delete_entry(kv, "tax")
        await until(lambda t: set(t) == {"legal"})
        assert set(await read_entries(kv)) == {"legal"}
        await watcher.stop()
    finally:
        await nc.close()
