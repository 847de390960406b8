"""Preload on promote (issue 16): staged entries, the heartbeat bookkeeping, the worker's preloader, and the
promote / rollback paths when workers do not confirm. Gateways ignoring staged entries:
tests/serve/test_serve_staged_routes.py; the end-to-end run under traffic:
tests/integration/test_preload_on_promote.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from lorafleet.core import wire
from lorafleet.core.config import BaseModelSpec, FleetConfig
from lorafleet.core.fleet_state import (
    FleetEntry,
    ensure_fleet_bucket,
    is_served_key,
    preload_key,
    read_entries,
)
from lorafleet.registry import promote as prom
from lorafleet.registry import store
from lorafleet.registry.preload import PreloadTracker
from lorafleet.sidecar.preload import Preloader

BASE = "all-MiniLM-L6-v2"


def _entry(name: str, version: str, base: str = BASE) -> FleetEntry:
    return FleetEntry(name=name, base=base, adapter_id=f"{name}@v{version}", adapter_uri=f"models:/{name}/{version}",
                      version=version, registered_model=name, action="promote")


def _hb(worker: str, adapters: list[str], *, base: str = BASE, draining: bool = False) -> wire.Heartbeat:
    return wire.Heartbeat(worker=worker, bases=[base], adapters={base: adapters}, in_flight=0, batches_per_s=0.0,
                          tasks_done=0, pid=1, host="h", draining=draining)


def test_staged_keys_are_never_served_names() -> None:
    assert not is_served_key(preload_key("legal")) and is_served_key("legal")
    with pytest.raises(ValueError):  # a served name cannot be written under the staged prefix
        FleetEntry.model_validate({**_entry("x", "1").model_dump(), "name": preload_key("legal")})


def test_tracker_counts_live_workers_of_the_base() -> None:
    t = PreloadTracker(BASE, "legal@v2", stale_s=3.0)
    t.observe(_hb("w1", ["legal@v1"]), now=0.0)
    t.observe(_hb("w2", ["legal@v1", "legal@v2"]), now=0.0)
    t.observe(_hb("w3", [], draining=True), now=0.0)  # draining: takes no new work, nobody waits for it
    t.observe(_hb("w4", [], base="other"), now=0.0)  # another base
    assert (t.workers(1.0), t.confirmed(1.0)) == (["w1", "w2"], ["w2"])
    t.observe(_hb("w1", ["legal@v1", "legal@v2"]), now=2.0)
    assert t.confirmed(2.5) == ["w1", "w2"]
    assert t.workers(4.0) == ["w1"]  # w2 silent for more than stale_s: gone


class FakeCache:
    """Pure logic stand-in for AdapterCache: records what was preloaded."""

    def __init__(self, fail: bool = False) -> None:
        self.preloaded: list[tuple[str, str | None]] = []
        self.fail = fail

    def preload(self, adapter_id: str, uri: str | None) -> str:
        if self.fail:
            raise RuntimeError("out of memory")
        self.preloaded.append((adapter_id, uri))
        return "registry"


def test_preloader_fetches_off_thread_and_loads_between_batches() -> None:
    resolved: list[str] = []
    preloader = Preloader([BASE], lambda uri: resolved.append(uri) or Path("/x"))  # type: ignore[func-returns-value]
    cache = FakeCache()
    try:
        assert not preloader.request(_entry("legal", "2", base="other"))  # not a base of this worker
        assert preloader.request(_entry("legal", "2"))
        assert not preloader.request(_entry("legal", "2"))  # asked already (a watcher replays entries)
        deadline = time.monotonic() + 10
        while not preloader.run_pending({BASE: cache}):  # type: ignore[dict-item]  # once the fetch thread is done
            assert time.monotonic() < deadline, "the fetch thread never handed the adapter over"
            time.sleep(0.01)
        assert resolved == ["models:/legal/2"] and cache.preloaded == [("legal@v2", "models:/legal/2")]
        assert preloader.request(_entry("legal", "2"))  # done: a later staging (a rollback) asks again
    finally:
        preloader.close()


def _drain(preloader: Preloader, cache: FakeCache) -> None:
    """Close the fetch thread, wait for it to end, then load what it handed over."""
    preloader.close()
    assert preloader._thread is not None
    preloader._thread.join(10)
    preloader.run_pending({BASE: cache})  # type: ignore[dict-item]


def test_preloader_tries_a_failed_fetch_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers on one host race for the same bundle cache folder: a transient error is tried again."""
    from lorafleet.sidecar import preload as worker_preload

    monkeypatch.setattr(worker_preload, "RETRY_PAUSE_S", 0.0)
    calls: list[str] = []

    def flaky(uri: str) -> Path:
        calls.append(uri)
        if len(calls) == 1:
            raise OSError(39, "Directory not empty")
        return Path("/x")

    preloader, cache = Preloader([BASE], flaky), FakeCache()
    preloader.request(_entry("legal", "2"))
    _drain(preloader, cache)
    assert len(calls) == 2 and cache.preloaded == [("legal@v2", "models:/legal/2")]


def test_preloader_refused_uri_loads_nothing() -> None:
    from lorafleet.core.adapters import AdapterUnavailable

    calls: list[str] = []

    def refuse(uri: str) -> Path:
        calls.append(uri)
        raise AdapterUnavailable(f"{uri} is not allowed on this worker")

    preloader = Preloader([BASE], refuse)
    try:
        preloader.request(_entry("legal", "2"))
        cache = FakeCache()
        _drain(preloader, cache)
        assert cache.preloaded == [] and len(calls) == 1  # a refusal is final: not tried again
        assert preloader.request(_entry("legal", "2"))  # not stuck as pending
    finally:
        preloader.close()


# -- promote / rollback when a worker does not confirm (a scripted heartbeat stands in for the worker) ------

@contextlib.asynccontextmanager
async def _heartbeats(url: str, adapters: list[str]) -> AsyncIterator[None]:
    import nats

    nc = await nats.connect(url)

    async def beat() -> None:
        while True:
            await nc.publish(wire.heartbeat_subject("stuck-1"), _hb("stuck-1", adapters, base="tiny").to_wire())
            await asyncio.sleep(0.2)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await nc.close()


def _promote_while_beating(url: str, adapters: list[str], fn: object) -> object:
    async def run() -> object:
        async with _heartbeats(url, adapters):
            return await asyncio.to_thread(fn)  # type: ignore[arg-type]

    return asyncio.run(run())


@pytest.mark.integration
def test_unconfirmed_preload_fails_promote_and_rollback_goes_ahead(nats_server, tmp_path: Path, tiny_adapter: Path,
                                                                   tiny_model_dir: Path) -> None:
    url = nats_server.url
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(FleetConfig(bases=[BaseModelSpec(name="tiny", source="x")]).model_dump_json())
    for score in (0.40, 0.45):
        store.register_bundle("legal", tiny_adapter, base_source=str(tiny_model_dir), base_name="tiny",
                              metrics={"test_ndcg@10": score, "base_test_ndcg@10": 0.30})

    async def make_bucket() -> None:
        import nats

        nc = await nats.connect(url)
        await ensure_fleet_bucket(nc.jetstream())
        await nc.close()

    asyncio.run(make_bucket())
    lines: list[str] = []
    fast = prom.Preload(timeout_s=3.0, progress=lines.append)
    # No worker of the base: nothing to wait for.
    out = prom.promote("legal", "1", nats_url=url, fleet_file=fleet_file, preload=fast)
    assert out.preload is not None and out.preload.workers == [] and any("nothing to preload" in x for x in lines)

    # A live worker that never lists legal@v2: the promotion fails, naming it; nothing changed.
    with pytest.raises(prom.PromotionError, match=r"1 of 1 worker\(s\) of base tiny did not confirm loading "
                                                  r"legal@v2 within 3s: stuck-1; nothing changed"):
        _promote_while_beating(url, ["legal@v1"], lambda: prom.promote("legal", "2", nats_url=url,
                                                                       fleet_file=fleet_file, preload=fast))
    assert store.alias_version("legal", "champion") == "1"
    keys = asyncio.run(_keys(url))
    assert preload_key("legal") not in keys and "legal" in keys
    assert any("workers confirmed 0/1" in x for x in lines)

    # One that does list it: promoted, the staged key gone.
    out = _promote_while_beating(url, ["legal@v2"], lambda: prom.promote("legal", "2", nats_url=url,  # type: ignore
                                                                         fleet_file=fleet_file, preload=fast))
    assert out.preload.complete and out.preload.confirmed == ["stuck-1"]  # type: ignore[attr-defined]
    assert preload_key("legal") not in asyncio.run(_keys(url))

    # A rollback is urgent: it goes ahead after the timeout and says who did not confirm.
    lines.clear()
    out = _promote_while_beating(url, ["legal@v2"], lambda: prom.rollback("legal", nats_url=url,  # type: ignore
                                                                          fleet_file=fleet_file, preload=fast))
    assert out.version == "1" and out.preload.missing == ["stuck-1"]  # type: ignore[attr-defined]
    assert any("switching anyway" in x for x in lines)
    assert asyncio.run(_kv_entries(url))["legal"].adapter_id == "legal@v1"
    # --no-preload: no waiting at all.
    out = prom.promote("legal", "2", nats_url=url, fleet_file=fleet_file, preload=prom.Preload(enabled=False))
    assert out.preload is None and store.alias_version("legal", "champion") == "2"


async def _keys(url: str) -> list[str]:
    import nats

    nc = await nats.connect(url)
    try:
        return list(await (await nc.jetstream().key_value("lorafleet_fleet")).keys())
    finally:
        await nc.close()


async def _kv_entries(url: str) -> dict[str, FleetEntry]:
    import nats

    nc = await nats.connect(url)
    try:
        return await read_entries(await nc.jetstream().key_value("lorafleet_fleet"))
    finally:
        await nc.close()

