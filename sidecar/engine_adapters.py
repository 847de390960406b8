"""The adapters loaded on one engine runtime: resolved and loaded on first use, least recently used evicted.

The async counterpart of `adapters.AdapterCache`, for engine runtimes: sequences run concurrently,
so a new adapter is loaded once however many tasks ask for it at the same moment (the others await
that load), an adapter with sequences in flight is never evicted (the cache may then exceed its
capacity until one finishes), and resolving a URI (a registry download, sha256 checks) runs in a
thread, never on the event loop. A new version of a bundle has a new adapter id (`NAME@vN`), so a
promotion loads it beside the old one, with no engine restart.

Eviction under concurrency (every change of the state below is synchronous; after each await it is read
again): a victim is idle (no sequence uses it) when picked and is taken out of `loaded` in the same step,
marked leaving, before its unload is awaited, so no other load picks it and no acquire takes it while the
engine drops it; an acquire of a leaving adapter waits for the unload to return, then loads it again (the
engine never sees a load and an unload of one name at once). A load evicts one victim at a time and counts
the loads past their resolve as taking a place, so concurrent loads evict just enough between them.

Capacity: an engine with its own adapter cache (`EngineRuntime.adapter_capacity`, vLLM's
max_cpu_loras) sets the bound, not the worker's `max_adapters`: unloading sooner would throw away
adapters the engine still holds in host memory, keeping more registered would leave the engine
rereading adapter folders on its own, which the bundle cache may delete meanwhile.

Engine restarts (`reset`): the engine forgot every adapter, so the table starts empty in a new epoch. A
sequence that acquired before the restart may still be finishing (its stream fails a moment later); its
release carries the epoch it acquired in and is ignored in a newer one, so it never lowers the count of a
sequence that loaded the adapter again after the restart (which would let a load evict it while in use).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.sidecar.adapters import AdapterEvents
from lorafleet.sidecar.runtime import EngineRuntime

log = logging.getLogger(__name__)


class EngineAdapters:
    def __init__(self, runtime: EngineRuntime, capacity: int, resolve: Callable[[str], Path],
                 events: AdapterEvents | None = None) -> None:
        capacity = runtime.adapter_capacity or capacity
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.runtime = runtime
        self.capacity = capacity
        self.resolve = resolve
        self.events = events  # loads and evictions, for the worker's metrics
        self._loaded: OrderedDict[str, int] = OrderedDict()  # adapter id → sequences using it, LRU order
        self._loading: dict[str, asyncio.Future[None]] = {}  # loads in progress; done when loaded or failed
        self._leaving: dict[str, asyncio.Future[None]] = {}  # victims being unloaded; done when the unload returns
        self._placing: set[str] = set()  # loads past their resolve: each takes a place in the capacity
        self.changed = False  # set on every load and eviction (heartbeats list the loaded adapters)
        self._epoch = 0  # engine generation: +1 per reset; counts in `loaded` belong to the current one

    def loaded(self) -> list[str]:
        return list(self._loaded)

    @property
    def epoch(self) -> int:
        return self._epoch

    async def acquire(self, adapter_id: str, uri: str | None) -> int:
        """Make `adapter_id` loaded, most recent and in use; returns the epoch the use counts in, for `release`.
        AdapterUnavailable when it can never load; any other exception is transient."""
        while adapter_id not in self._loaded:
            leaving = self._leaving.get(adapter_id)
            if leaving is not None:  # load it again only once the engine dropped it
                await asyncio.shield(leaving)
                continue
            pending = self._loading.get(adapter_id)
            if pending is not None:
                await asyncio.shield(pending)  # the loader's error is raised there too
                continue
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._loading[adapter_id] = future
            try:
                await self._load(adapter_id, uri)
                future.set_result(None)
            except BaseException as exc:
                future.set_exception(exc)
                future.exception()  # retrieved: waiters re-raise it, nobody logs "never retrieved"
                raise
            finally:
                del self._loading[adapter_id]
        self._loaded[adapter_id] += 1  # no await since the loop saw it loaded: counted in the current epoch
        self._loaded.move_to_end(adapter_id)
        return self._epoch

    def release(self, adapter_id: str, epoch: int) -> None:
        """End one use of `adapter_id` that `acquire` counted in `epoch`; a use from before a reset is ignored (its
        count went with the old engine)."""
        if epoch == self._epoch and adapter_id in self._loaded:
            self._loaded[adapter_id] = max(self._loaded[adapter_id] - 1, 0)

    def reset(self) -> None:
        """The engine restarted and forgot every adapter: a new epoch, with nothing loaded and nothing in use."""
        self._epoch += 1
        self._loaded.clear()
        self.changed = True

    async def _load(self, adapter_id: str, uri: str | None) -> None:
        if not uri:
            raise AdapterUnavailable(f"adapter {adapter_id!r} has no URI (neither in the task nor in the fleet config)")
        path = await asyncio.to_thread(self.resolve, uri)
        self._placing.add(adapter_id)
        try:
            while (victim := self._victim()) is not None:
                await self._evict(victim)
            await self.runtime.load_adapter(adapter_id, str(path))
        finally:
            self._placing.discard(adapter_id)
        self._loaded[adapter_id] = 0
        self.changed = True
        if self.events is not None:
            self.events.loaded(len(self._loaded))

    def _victim(self) -> str | None:
        """The least recently used idle adapter while the loaded ones and the loads placing one are over
        capacity; None when within it or when every loaded adapter is in use (then over it until one finishes)."""
        if len(self._loaded) + len(self._placing) <= self.capacity:
            return None
        return next((a for a, users in self._loaded.items() if users == 0), None)

    async def _evict(self, victim: str) -> None:
        log.info("evicting adapter %s (LRU, capacity %d)", victim, self.capacity)
        # Reserve first: out of `loaded` (no acquire takes it, no other load picks it) before the engine call.
        del self._loaded[victim]
        self.changed = True
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._leaving[victim] = done
        try:
            await self.runtime.unload_adapter(victim)
        finally:
            # Released however the unload ended; after an error the engine may still hold it (a later load of
            # it is the runtime's to reconcile).
            del self._leaving[victim]
            done.set_result(None)
        if self.events is not None:
            self.events.evicted(len(self._loaded))
