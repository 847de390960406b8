"""The per-base LRU of loaded adapters on one runtime.

URIs are resolved by the core adapter-source contract (`lorafleet.adapters.resolve_adapter_uri`:
plain paths, `file://`, and plugin schemes such as the registry's `models:`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from lorafleet.adapters import AdapterUnavailable, resolve_adapter_uri
from lorafleet.sidecar.runtime import Runtime

log = logging.getLogger(__name__)


class LruSet:
    """Keys in least-recently-used order; `touch` returns the keys that fell out beyond `capacity`."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> list[str]:
        return list(self._keys)

    def touch(self, key: str) -> list[str]:
        self._keys[key] = None
        self._keys.move_to_end(key)
        evicted: list[str] = []
        while len(self._keys) > self.capacity:
            old, _ = self._keys.popitem(last=False)
            evicted.append(old)
        return evicted

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)


class AdapterEvents(Protocol):
    """Told of every load and eviction, with the number of adapters held after it (metrics.AdapterEvents)."""

    def loaded(self, held: int) -> None: ...

    def evicted(self, held: int) -> None: ...


class AdapterCache:
    """Keeps at most `max_adapters` adapters loaded on one runtime; loads on demand, evicts LRU."""

    def __init__(self, runtime: Runtime, max_adapters: int,
                 resolve: Callable[[str], Path] = resolve_adapter_uri, events: AdapterEvents | None = None) -> None:
        self.runtime = runtime
        self.lru = LruSet(max_adapters)
        self.resolve = resolve
        self.events = events

    def ensure(self, adapter_id: str, uri: str | None) -> bool:
        """Make `adapter_id` loaded and most recent; True when it had to be loaded now."""
        if adapter_id in self.lru:
            self.lru.touch(adapter_id)
            return False
        if not uri:
            raise AdapterUnavailable(f"adapter {adapter_id!r} has no URI (neither in the task nor in the fleet config)")
        path = self.resolve(uri)
        # Evict first, so peak memory stays at max_adapters.
        while len(self.lru) >= self.lru.capacity:
            victim = self.lru.keys()[0]
            log.info("evicting adapter %s (LRU, max_adapters=%d)", victim, self.lru.capacity)
            self.lru.discard(victim)
            self.runtime.unload_adapter(victim)
            if self.events is not None:
                self.events.evicted(len(self.lru))
        self.runtime.load_adapter(adapter_id, str(path))
        self.lru.touch(adapter_id)
        if self.events is not None:
            self.events.loaded(len(self.lru))
        return True

    def loaded(self) -> list[str]:
        return self.lru.keys()
