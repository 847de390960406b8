"""Adapter sources and the per-base LRU of loaded adapters.

`resolve_adapter_uri` turns an adapter URI into a local peft directory. Plain paths and
`file://` work today; other schemes (MLflow `models:/name/3`, `mlflow-artifacts:/…`) plug in
with `register_adapter_scheme` — that is the extension point for the registry.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from lorafleet.sidecar.runtime import AdapterUnavailable, Runtime

log = logging.getLogger(__name__)

AdapterResolver = Callable[[str], Path]
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
_RESOLVERS: dict[str, AdapterResolver] = {}
ADAPTER_FILES = ("adapter_config.json",)


def register_adapter_scheme(scheme: str, resolver: AdapterResolver) -> None:
    """Make `scheme:` URIs loadable: `resolver(uri)` returns a local peft directory (downloading if it must)."""
    _RESOLVERS[scheme.lower()] = resolver


def _file_uri(uri: str) -> Path:
    return Path(unquote(urlsplit(uri).path))


register_adapter_scheme("file", _file_uri)


def resolve_adapter_uri(uri: str) -> Path:
    """A local directory holding a peft adapter; AdapterUnavailable (a permanent failure) otherwise."""
    if not uri:
        raise AdapterUnavailable("empty adapter URI")
    m = _SCHEME_RE.match(uri)
    if m:
        scheme = m.group(1).lower()
        resolver = _RESOLVERS.get(scheme)
        if resolver is None:
            raise AdapterUnavailable(
                f"no resolver for adapter URI scheme '{scheme}:' ({uri}); known: {sorted(_RESOLVERS)} "
                "(add one with lorafleet.sidecar.adapters.register_adapter_scheme)"
            )
        path = resolver(uri)
    else:
        path = Path(uri)
    path = path.expanduser()
    if not path.is_dir():
        raise AdapterUnavailable(f"adapter directory {path} does not exist (from {uri})")
    for name in ADAPTER_FILES:
        if not (path / name).is_file():
            raise AdapterUnavailable(f"adapter directory {path} has no {name} (not a peft adapter)")
    return path.resolve()


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


class AdapterCache:
    """Keeps at most `max_adapters` adapters loaded on one runtime; loads on demand, evicts LRU."""

    def __init__(self, runtime: Runtime, max_adapters: int,
                 resolve: Callable[[str], Path] = resolve_adapter_uri) -> None:
        self.runtime = runtime
        self.lru = LruSet(max_adapters)
        self.resolve = resolve

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
        self.runtime.load_adapter(adapter_id, str(path))
        self.lru.touch(adapter_id)
        return True

    def loaded(self) -> list[str]:
        return self.lru.keys()
