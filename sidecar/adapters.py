"""The adapters of one base on one runtime, in memory tiers bounded in bytes: device → host → disk → registry.

- **device** (hot): loaded on the runtime, ready to compute; at most `max_adapters` of them and
  `device_bytes` of weights, least recently used moved down first.
- **host** (warm): `AdapterWeights` read into host memory (`Runtime.read_adapter`), loaded back with
  `Runtime.load_adapter_weights` without touching the disk; at most `host_bytes`, least recently used
  dropped. Only for runtimes that return weights from `read_adapter` (others keep no host tier).
- **disk**: the peft folder a URI resolves to (a local path, or the registry's bundle cache, which
  `registry.store` bounds by `LORAFLEET_BUNDLE_CACHE_BYTES`); **registry**: what a plugin scheme such as
  `models:` downloads into that cache. URIs are resolved by the core adapter-source contract
  (`lorafleet.core.adapters.resolve_adapter_uri`, or the worker's `AdapterPolicy.resolve`).

An adapter's bytes are its weights' `nbytes` when the runtime read them, else the size of its
`*.safetensors` / `*.bin` files. A hot adapter keeps a reference to its host copy, so moving it down costs
no disk read; that copy is host memory beside what the device holds (on a CPU device the same memory,
when the runtime shares the tensors as the sentence-transformers runtime does), so adapter weights take
at most `device_bytes` on the device and `device_bytes + host_bytes` of host memory.

`use(wanted)` pins the adapters a batch needs while it computes: a pinned adapter is never evicted, an
adapter that finds no room because everything else hot is pinned is deferred (the caller runs it in a
next pass), and a failed load fails only that adapter. A URI that may download (a plugin scheme such as
`models:`, the registry tier) is resolved on a thread of its own (`Fetches`): its adapter is `fetching`
until that ends, and the caller defers its tasks, so a download and its sha256 checks never stop the
compute thread (every base it serves). Local folders resolve in place (a few stat calls). The cache
itself is main thread only, like the runtime; `preload` and `ensure` resolve in place, on the thread
that calls them.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from lorafleet.core.adapters import AdapterUnavailable, local_path_of, resolve_adapter_uri
from lorafleet.core.config import MIB
from lorafleet.sidecar.runtime import AdapterWeights, Runtime

log = logging.getLogger(__name__)

DEVICE, HOST = "device", "host"  # the tiers the cache holds
DISK, REGISTRY = "disk", "registry"  # where a load from below the cache came from (a local path; a plugin scheme)
TIERS = (DEVICE, HOST)
SOURCES = (HOST, DISK, REGISTRY)
WEIGHT_SUFFIXES = (".safetensors", ".bin")
DEFAULT_MAX_ADAPTERS = 1024
DEFAULT_DEVICE_BYTES = 256 * MIB
DEFAULT_HOST_BYTES = 512 * MIB


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
    """Told of every load and eviction (metrics.AdapterEvents). `loaded`/`evicted` carry the number of adapters
    on the device after it (engine runtimes call only these two); the tiered cache also says where a load came
    from, which tier an eviction left, and each tier's size after a change."""

    def loaded(self, held: int) -> None: ...

    def evicted(self, held: int) -> None: ...

    def loaded_from(self, source: str) -> None:
        """A load onto the device from `source`: "host", "disk" or "registry"."""

    def evicted_from(self, tier: str) -> None:
        """An adapter left `tier` to make room: "device" (moved to host, or dropped) or "host" (dropped)."""

    def tier_size(self, tier: str, adapters: int, nbytes: int) -> None:
        """What `tier` holds now."""


@dataclass(frozen=True, slots=True)
class TierStats:
    adapters: int
    nbytes: int
    limit_bytes: int


@dataclass(slots=True)
class AdapterUse:
    """What `AdapterCache.use` could do for the adapters a batch wants."""

    ready: set[str] = field(default_factory=set)  # on the device, pinned until the with-block ends
    failed: dict[str, BaseException] = field(default_factory=dict)  # AdapterUnavailable: permanent; else transient
    deferred: set[str] = field(default_factory=set)  # no room now (everything else hot is pinned): run them next
    fetching: dict[str, Future[Path]] = field(default_factory=dict)  # URI still resolving (a download): run later
    loaded_now: set[str] = field(default_factory=set)  # ready ones that had to be loaded
    sources: dict[str, str] = field(default_factory=dict)  # loaded_now id → "host" | "disk" | "registry"


@dataclass(slots=True)
class _Held:
    nbytes: int
    weights: AdapterWeights | None  # the host copy (None: this runtime loads from disk only)


class NoRoom(Exception):
    """Every adapter that could make room is pinned."""


class Fetching(Exception):
    """The adapter's URI is being resolved on a fetch thread; `future` ends with its folder or what it raised."""

    def __init__(self, future: Future[Path]) -> None:
        super().__init__("adapter URI still resolving")
        self.future = future


class Fetches:
    """URI resolves that may download, each on a daemon thread of its own (one per URI at a time).

    `start` returns the running fetch of a URI, or starts one; a finished one is handed out until a load
    takes its result (`forget`), and the next load after that resolves afresh (a failure is retried, a
    bundle evicted from the cache downloaded again). Daemon threads: a download that hangs never keeps
    the worker from exiting. Any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, Future[Path]] = {}

    def start(self, uri: str, resolve: Callable[[str], Path]) -> Future[Path]:
        with self._lock:
            future = self._running.get(uri)
            if future is None:
                future = self._running[uri] = Future()
                threading.Thread(target=_fetch, args=(future, resolve, uri), name="adapter-fetch", daemon=True).start()
            return future

    def forget(self, uri: str, future: Future[Path]) -> None:
        with self._lock:
            if self._running.get(uri) is future:
                del self._running[uri]


def _fetch(future: Future[Path], resolve: Callable[[str], Path], uri: str) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        path = resolve(uri)
    except BaseException as exc:  # AdapterUnavailable: permanent; anything else: the tasks are retried
        future.set_exception(exc)
    else:
        future.set_result(path)


def files_nbytes(path: Path) -> int:
    """Bytes of an adapter folder's weight files (0 when there are none to see)."""
    try:
        return sum(p.stat().st_size for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    except OSError:
        return 0


def source_of(uri: str) -> str:
    return DISK if local_path_of(uri) is not None else REGISTRY


class AdapterCache:
    """The device and host tiers of one base's adapters on one runtime (see the module docstring)."""

    def __init__(self, runtime: Runtime, max_adapters: int = DEFAULT_MAX_ADAPTERS,
                 resolve: Callable[[str], Path] = resolve_adapter_uri, events: AdapterEvents | None = None, *,
                 device_bytes: int = DEFAULT_DEVICE_BYTES, host_bytes: int = DEFAULT_HOST_BYTES,
                 fetches: Fetches | None = None) -> None:
        if max_adapters < 1:
            raise ValueError("max_adapters must be at least 1")
        if device_bytes < 1 or host_bytes < 0:
            raise ValueError("device_bytes must be positive and host_bytes not negative")
        self.runtime = runtime
        self.max_adapters = max_adapters
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes
        self.resolve = resolve
        self.events = events
        self.fetches = fetches if fetches is not None else Fetches()
        self._hot: OrderedDict[str, _Held] = OrderedDict()  # LRU order, most recent last
        self._warm: OrderedDict[str, AdapterWeights] = OrderedDict()
        self._hot_bytes = 0
        self._warm_bytes = 0
        self._pins: Counter[str] = Counter()

    # -- what callers ask ----------------------------------------------------------------------------
    @contextmanager
    def use(self, wanted: Mapping[str, str | None], *, fetch_aside: bool = True) -> Iterator[AdapterUse]:
        """Make the `wanted` adapters (id → URI, None when none is known) hot and pin them for the with-block.

        `fetch_aside`: a URI that may download resolves on a fetch thread (the adapter is `fetching` meanwhile);
        False resolves it here. Progress: unless another open `use` pins adapters, at least one wanted adapter
        ends ready, failed or fetching."""
        use = AdapterUse()
        pinned: list[str] = []
        try:
            for adapter_id in wanted:  # pin the hot ones first, so loading the others cannot evict them
                if adapter_id in self._hot:
                    self._hot.move_to_end(adapter_id)
                    self._pin(adapter_id, pinned)
                    use.ready.add(adapter_id)
            for adapter_id, uri in wanted.items():
                if adapter_id in use.ready:
                    continue
                try:
                    use.sources[adapter_id] = self._load(adapter_id, uri, fetch_aside)
                except NoRoom:
                    use.deferred.add(adapter_id)
                    continue
                except Fetching as fetching:
                    use.fetching[adapter_id] = fetching.future
                    continue
                except Exception as exc:  # the caller fails this adapter's tasks with it (transient)
                    use.failed[adapter_id] = exc
                    continue
                self._pin(adapter_id, pinned)
                use.ready.add(adapter_id)
                use.loaded_now.add(adapter_id)
            yield use
        finally:
            for adapter_id in pinned:
                self._pins[adapter_id] -= 1
                if self._pins[adapter_id] <= 0:
                    del self._pins[adapter_id]

    def preload(self, adapter_id: str, uri: str | None) -> str:
        """Make `adapter_id` hot, or warm when the device has no room; returns where it came from: "device" (it
        was hot), "host", "disk" or "registry". Raises what its load raised."""
        if adapter_id in self._hot:
            self._hot.move_to_end(adapter_id)
            return DEVICE
        was_warm = adapter_id in self._warm
        with self.use({adapter_id: uri}, fetch_aside=False) as use:
            if adapter_id in use.failed:
                raise use.failed[adapter_id]
            if adapter_id not in use.deferred:
                return use.sources[adapter_id]
        if adapter_id not in self._warm:
            raise RuntimeError(f"no room for adapter {adapter_id!r} on the device (every hot adapter is pinned) nor "
                               "in host memory")
        log.info("preloaded adapter %s into host memory only (every hot adapter is pinned)", adapter_id)
        return HOST if was_warm or not uri else source_of(uri)

    def ensure(self, adapter_id: str, uri: str | None) -> bool:
        """Make `adapter_id` hot and most recent (not pinned); True when it had to be loaded now."""
        with self.use({adapter_id: uri}, fetch_aside=False) as use:
            if adapter_id in use.failed:
                raise use.failed[adapter_id]
            if adapter_id in use.deferred:
                raise RuntimeError(f"no room for adapter {adapter_id!r}: every hot adapter is pinned")
            return adapter_id in use.loaded_now

    def loaded(self) -> list[str]:
        """The hot adapters, least recently used first."""
        return list(self._hot)

    def tier_of(self, adapter_id: str) -> str | None:
        if adapter_id in self._hot:
            return DEVICE
        return HOST if adapter_id in self._warm else None

    def stats(self) -> dict[str, TierStats]:
        return {DEVICE: TierStats(len(self._hot), self._hot_bytes, self.device_bytes),
                HOST: TierStats(len(self._warm), self._warm_bytes, self.host_bytes)}

    # -- loading and eviction -------------------------------------------------------------------------
    def _pin(self, adapter_id: str, pinned: list[str]) -> None:
        self._pins[adapter_id] += 1
        pinned.append(adapter_id)

    def _load(self, adapter_id: str, uri: str | None, fetch_aside: bool = False) -> str:
        """Load a cold or warm adapter onto the device; returns its source. NoRoom when it cannot fit now,
        Fetching while its URI resolves on a fetch thread (`fetch_aside`)."""
        weights = self._warm.get(adapter_id)
        if weights is not None:
            self._check_fits(adapter_id, weights.nbytes)
            # Out of the host tier while it moves up, so the room made below never drops this very copy.
            self._drop_warm(adapter_id, evicted=False)
            try:
                self._make_room(weights.nbytes)
                self.runtime.load_adapter_weights(adapter_id, weights)
            except AdapterUnavailable:
                raise
            except Exception:
                self._stash(adapter_id, weights)  # no room now, or a transient failure: keep it warm
                raise
            self._add_hot(adapter_id, _Held(weights.nbytes, weights), HOST)
            return HOST
        if not uri:
            raise AdapterUnavailable(f"adapter {adapter_id!r} has no URI (neither in the task nor in the fleet config)")
        source = source_of(uri)
        path = self._resolve_aside(uri) if fetch_aside and source == REGISTRY else self.resolve(uri)
        weights = self.runtime.read_adapter(adapter_id, str(path))
        nbytes = weights.nbytes if weights is not None else files_nbytes(path)
        self._check_fits(adapter_id, nbytes)
        try:
            self._make_room(nbytes)
        except NoRoom:
            if weights is not None:
                self._stash(adapter_id, weights)  # read already: the next pass loads it from host memory
            raise
        if weights is not None:
            self.runtime.load_adapter_weights(adapter_id, weights)
        else:
            self.runtime.load_adapter(adapter_id, str(path))
        self._add_hot(adapter_id, _Held(nbytes, weights), source)
        return source

    def _resolve_aside(self, uri: str) -> Path:
        """The folder of `uri` once its fetch has ended (raising what it raised); Fetching until then."""
        future = self.fetches.start(uri, self.resolve)
        if not future.done():
            raise Fetching(future)
        self.fetches.forget(uri, future)  # taken: a later load (after an eviction) resolves afresh
        return future.result()

    def _check_fits(self, adapter_id: str, nbytes: int) -> None:
        if nbytes > self.device_bytes:
            raise AdapterUnavailable(
                f"adapter {adapter_id!r} has {nbytes} bytes of weights, more than the {self.device_bytes} bytes this "
                "worker keeps on the device per base (raise worker.profile.adapter_device_bytes)")

    def _make_room(self, nbytes: int) -> None:
        """Evict unpinned hot adapters, least recently used first, until one of `nbytes` fits; NoRoom if it can't."""
        unpinned = [a for a in self._hot if a not in self._pins]
        room_bytes = self._hot_bytes + nbytes - sum(self._hot[a].nbytes for a in unpinned)
        if room_bytes > self.device_bytes or len(self._hot) - len(unpinned) + 1 > self.max_adapters:
            raise NoRoom  # decided before unloading anything, so a deferral costs no eviction
        for victim in unpinned:
            if len(self._hot) + 1 <= self.max_adapters and self._hot_bytes + nbytes <= self.device_bytes:
                break
            self._evict_hot(victim)

    def _add_hot(self, adapter_id: str, held: _Held, source: str) -> None:
        self._hot[adapter_id] = held
        self._hot_bytes += held.nbytes
        if self.events is not None:
            self.events.loaded(len(self._hot))
            self.events.loaded_from(source)
            self._report(DEVICE)

    def _evict_hot(self, victim: str) -> None:
        log.info("evicting adapter %s from the device (LRU; max_adapters=%d, adapter_device_bytes=%d)", victim,
                 self.max_adapters, self.device_bytes)
        self.runtime.unload_adapter(victim)
        held = self._hot.pop(victim)
        self._hot_bytes -= held.nbytes
        if self.events is not None:
            self.events.evicted(len(self._hot))
            self.events.evicted_from(DEVICE)
            self._report(DEVICE)
        if held.weights is not None:
            self._stash(victim, held.weights)

    def _stash(self, adapter_id: str, weights: AdapterWeights) -> None:
        """Keep a host copy, dropping the least recently used ones beyond host_bytes (none if it cannot fit)."""
        if weights.nbytes > self.host_bytes:
            return
        self._drop_warm(adapter_id, evicted=False)
        while self._warm and self._warm_bytes + weights.nbytes > self.host_bytes:
            self._drop_warm(next(iter(self._warm)), evicted=True)
        self._warm[adapter_id] = weights
        self._warm_bytes += weights.nbytes
        if self.events is not None:
            self._report(HOST)

    def _drop_warm(self, adapter_id: str, evicted: bool) -> None:
        weights = self._warm.pop(adapter_id, None)
        if weights is None:
            return
        self._warm_bytes -= weights.nbytes
        if self.events is not None:
            if evicted:
                self.events.evicted_from(HOST)
            self._report(HOST)

    def _report(self, tier: str) -> None:
        assert self.events is not None
        s = self.stats()[tier]
        self.events.tier_size(tier, s.adapters, s.nbytes)
