"""Adapters of an engine runtime under concurrency (issue 23, item 1): evictions, loads and unloads that
interleave inside one another's awaits.

`EngineAdapters` is driven by concurrent acquire/release/loads against a fake engine whose unloads wait at a
gate the test opens, so other operations run inside one unload. The vLLM client (`VllmEngine`, and
`VllmRuntime` on top) talks to a mock server that answers the adapter routes as vLLM 0.32 does (a load of a
name still registered: 400 "has already been loaded"; an unknown name: 404).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.core.config import BaseModelSpec
from lorafleet.core.wire import GENERATE
from lorafleet.sidecar.engine_adapters import EngineAdapters
from lorafleet.sidecar.runtime import EngineRuntime, Generated, GenerateInput
from lorafleet.sidecar.vllm_engine import EngineConfig, EngineError, VllmEngine
from lorafleet.sidecar.vllm_runtime import VllmRuntime


class GatedEngine(EngineRuntime):
    """An engine's adapter registry. A load of a name it still holds is refused as vllm_runtime reports vLLM's
    "already loaded" (AdapterUnavailable); unloads wait at `gate` while it is clear."""

    capabilities: ClassVar[frozenset[str]] = frozenset({GENERATE})

    def __init__(self, yield_steps: int = 0) -> None:
        self.registered: set[str] = set()
        self.unloading: list[str] = []  # unloads in flight, in call order
        self.unloaded: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.yield_steps = yield_steps  # loop steps each load and unload takes (for the random interleavings)
        self._changed = asyncio.Condition()

    async def start(self) -> None: ...

    @property
    def slots(self) -> int:
        return 8

    async def stream(self, item: GenerateInput, adapter_id: str | None) -> AsyncIterator[str | Generated]:
        yield Generated("", 0, 0, "stop")

    async def load_adapter(self, adapter_id: str, path: str) -> None:
        for _ in range(self.yield_steps):
            await asyncio.sleep(0)
        if adapter_id in self.registered:
            raise AdapterUnavailable(f"engine answered 400: The lora adapter '{adapter_id}' has already been loaded.")
        self.registered.add(adapter_id)

    async def unload_adapter(self, adapter_id: str) -> None:
        self.unloading.append(adapter_id)
        async with self._changed:
            self._changed.notify_all()
        await self.gate.wait()
        for _ in range(self.yield_steps):
            await asyncio.sleep(0)
        self.registered.remove(adapter_id)  # KeyError: unloaded twice
        self.unloading.remove(adapter_id)
        self.unloaded.append(adapter_id)

    def loaded_adapters(self) -> list[str]:
        return sorted(self.registered)

    async def until(self, predicate: Callable[[], bool]) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(predicate), 5.0)


async def three_loaded_idle(cache: EngineAdapters) -> None:
    """a, b, c loaded (LRU in that order) and idle, one more than capacity 2: a and b were in use when c loaded."""
    epochs = [await cache.acquire(name, f"/{name}") for name in "abc"]
    for name, epoch in zip("abc", epochs, strict=True):
        cache.release(name, epoch)
    assert cache.loaded() == ["a", "b", "c"]


async def test_an_adapter_acquired_during_an_eviction_is_not_unloaded() -> None:
    engine = GatedEngine()
    cache = EngineAdapters(engine, 2, Path)
    await three_loaded_idle(cache)
    await cache.acquire("c", "/c")  # c in use throughout
    engine.gate.clear()
    load_d = asyncio.create_task(cache.acquire("d", "/d"))  # over capacity by two: a goes first
    await engine.until(lambda: engine.unloading == ["a"])
    await cache.acquire("b", "/b")  # loaded and idle: in use from here, inside the unload of a
    engine.gate.set()
    await load_d
    assert "b" in engine.registered and "b" not in engine.unloaded  # never unloaded while in use
    assert sorted(cache.loaded()) == sorted(engine.registered) == ["b", "c", "d"]  # over capacity while in use


async def test_concurrent_loads_never_pick_the_same_victim() -> None:
    engine = GatedEngine()
    cache = EngineAdapters(engine, 2, Path)
    await three_loaded_idle(cache)
    engine.gate.clear()
    loads = [asyncio.create_task(cache.acquire(name, f"/{name}")) for name in "xy"]
    await engine.until(lambda: len(engine.unloading) == 2)  # both loads are evicting, each inside the other
    engine.gate.set()
    await asyncio.gather(*loads)
    assert sorted(engine.unloaded) == ["a", "b", "c"]  # each victim once
    assert sorted(cache.loaded()) == sorted(engine.registered) == ["x", "y"]


async def test_an_adapter_wanted_while_it_is_unloaded_is_loaded_again_after_the_unload() -> None:
    engine = GatedEngine()
    cache = EngineAdapters(engine, 2, Path)
    for name in "ba":  # LRU: b, a
        cache.release(name, await cache.acquire(name, f"/{name}"))
    engine.gate.clear()
    load_c = asyncio.create_task(cache.acquire("c", "/c"))
    await engine.until(lambda: engine.unloading == ["b"])
    again = asyncio.create_task(cache.acquire("b", "/b"))
    await asyncio.wait({again}, timeout=0.2)  # every chance to overtake the unload in the engine
    engine.gate.set()
    await asyncio.gather(load_c, again)  # before the fix: AdapterUnavailable ("already loaded"), dead-lettered
    assert "b" in engine.registered and sorted(cache.loaded()) == sorted(engine.registered)


@pytest.mark.parametrize("seed", range(5))
async def test_random_concurrent_sequences_never_lose_an_adapter_in_use(seed: int) -> None:
    """Many sequences over few slots: whenever a sequence holds an adapter, the engine has it registered."""
    rng = random.Random(seed)
    engine = GatedEngine(yield_steps=2)
    cache = EngineAdapters(engine, 3, Path)
    held: dict[str, int] = {}
    broken: list[str] = []

    async def sequence(name: str, start: int, steps: int) -> None:
        for _ in range(start):
            await asyncio.sleep(0)
        epoch = await cache.acquire(name, f"/{name}")
        held[name] = held.get(name, 0) + 1
        try:
            for _ in range(steps):
                if name not in engine.registered:
                    broken.append(name)
                await asyncio.sleep(0)
        finally:
            held[name] -= 1
            cache.release(name, epoch)

    await asyncio.gather(*(sequence(rng.choice("abcdefg"), rng.randint(0, 60), rng.randint(0, 6))
                           for _ in range(200)))
    assert broken == [] and sorted(cache.loaded()) == sorted(engine.registered)
    cache.release("z", await cache.acquire("z", "/z"))  # all idle now: the next load evicts down to capacity
    assert sorted(cache.loaded()) == sorted(engine.registered) and len(engine.registered) == 3


# ---- the vLLM client: loads and unloads of one name in the engine ------------------------------------------------

class FakeVllm:
    """vLLM 0.32's adapter routes. An unload waits "in transit" at `transit` while it is clear: a later request
    can reach the server first, as over separate connections."""

    def __init__(self) -> None:
        self.registered: dict[str, str] = {}
        self.transit = asyncio.Event()
        self.transit.set()
        self.unload_sent = asyncio.Event()
        self.refuse_loads = False  # answer every load "already loaded" (as if someone else kept loading it)
        self.log: list[tuple[str, str]] = []

    async def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        name = body["lora_name"]
        if request.url.path == "/v1/unload_lora_adapter":
            self.unload_sent.set()
            await self.transit.wait()
            if name not in self.registered:
                return httpx.Response(404, json={"error": {"message": f"The lora adapter '{name}' cannot be found."}})
            del self.registered[name]
            self.log.append(("unload", name))
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' removed successfully.")
        if name in self.registered or self.refuse_loads:
            return httpx.Response(400, json={"error": {"message": f"The lora adapter '{name}' has already been "
                                                       "loaded. If you want to load the adapter in place, set "
                                                       "'load_inplace' to True."}})
        self.registered[name] = body["lora_path"]
        self.log.append(("load", name))
        return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")


@pytest.fixture
async def vllm(tmp_path: Path) -> AsyncIterator[tuple[VllmRuntime, FakeVllm]]:
    server = FakeVllm()
    runtime = VllmRuntime(BaseModelSpec(name="tiny", source=str(tmp_path), runtime="vllm",
                                        options={"max_model_len": 64}))
    engine = VllmEngine(EngineConfig(model=str(tmp_path)))
    engine._client = httpx.AsyncClient(transport=httpx.MockTransport(server.handler), base_url="http://engine")
    runtime.engine = engine
    try:
        yield runtime, server
    finally:
        await engine._client.aclose()


async def test_a_load_of_a_name_being_unloaded_waits_for_the_unload(vllm: tuple[VllmRuntime, FakeVllm]) -> None:
    runtime, server = vllm
    await runtime.load_adapter("b", "/b")
    server.transit.clear()
    unload = asyncio.create_task(runtime.unload_adapter("b"))
    await server.unload_sent.wait()
    load = asyncio.create_task(runtime.load_adapter("b", "/b"))
    await asyncio.wait({load}, timeout=0.2)  # every chance to reach the engine before the unload
    server.transit.set()
    await asyncio.gather(unload, load)  # before the fix: AdapterUnavailable ("already loaded")
    assert server.log == [("load", "b"), ("unload", "b"), ("load", "b")]
    assert server.registered == {"b": "/b"} and runtime.loaded_adapters() == ["b"]


async def test_an_unload_keeps_the_name_until_the_engine_answers(vllm: tuple[VllmRuntime, FakeVllm]) -> None:
    runtime, server = vllm
    await runtime.load_adapter("b", "/b")
    server.transit.clear()
    unload = asyncio.create_task(runtime.unload_adapter("b"))
    await server.unload_sent.wait()
    assert runtime.loaded_adapters() == ["b"]  # still registered in the engine
    server.transit.set()
    await unload
    assert runtime.loaded_adapters() == [] and server.registered == {}


async def test_already_loaded_unknown_to_the_client_is_reloaded_not_unavailable(
        vllm: tuple[VllmRuntime, FakeVllm]) -> None:
    """The engine holds a name the client does not list (a load whose answer never came, e.g. cancelled)."""
    runtime, server = vllm
    server.registered["b"] = "/old"
    await runtime.load_adapter("b", "/b")  # before the fix: AdapterUnavailable, the task dead-lettered
    assert server.registered == {"b": "/b"} and runtime.loaded_adapters() == ["b"]


async def test_a_cancelled_load_leaves_nothing_the_next_load_trips_on(vllm: tuple[VllmRuntime, FakeVllm]) -> None:
    runtime, server = vllm
    server.transit.clear()
    await runtime.load_adapter("b", "/b")
    reload = asyncio.create_task(runtime.load_adapter("b", "/b2"))  # unload first (new path): held in transit
    await server.unload_sent.wait()
    reload.cancel()
    server.transit.set()
    with pytest.raises(asyncio.CancelledError):
        await reload
    await runtime.load_adapter("b", "/b2")
    assert server.registered == {"b": "/b2"} and runtime.loaded_adapters() == ["b"]


async def test_a_name_the_engine_keeps_refusing_is_a_transient_error(vllm: tuple[VllmRuntime, FakeVllm]) -> None:
    runtime, server = vllm
    server.refuse_loads = True
    with pytest.raises(EngineError) as err:  # retried later, not AdapterUnavailable (dead-lettered)
        await runtime.load_adapter("b", "/b")
    assert "already been loaded" in str(err.value) and runtime.loaded_adapters() == []
