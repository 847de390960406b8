"""Preloads a promotion asks for: a staged fleet-state entry (`fleet_state.PRELOAD_PREFIX`) becomes a load.

`lorafleet promote` stages the new version and waits until every live worker of its base lists the adapter
in its heartbeat before it switches the fleet. For a batch runtime, the NATS loop hands the staged entry to
`Preloader.request` (thread-safe); a fetch thread resolves its URI (the registry download and sha256
checks, through the worker's AdapterPolicy like every URI), so the batches being computed do not wait for
the download; the main thread then loads it into the base's adapter cache between batches
(`run_pending`) and the next heartbeat lists it. An engine runtime loads it through its own adapter cache
on the loop (`preload_engine`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.core.fleet_state import FleetEntry
from lorafleet.sidecar.adapters import AdapterCache
from lorafleet.sidecar.engine_adapters import EngineAdapters

log = logging.getLogger(__name__)

# A failed fetch is tried again (a registry hiccup, a race with another worker on the same bundle cache): a
# promotion waits for every worker's confirmation and would otherwise wait out its whole timeout.
ATTEMPTS = 3
RETRY_PAUSE_S = 1.0


class Preloader:
    """Staged adapters of this worker's bases: fetched on a thread of their own, loaded by the main thread."""

    def __init__(self, bases: Iterable[str], resolve: Callable[[str], Path]) -> None:
        self.bases = frozenset(bases)
        self.resolve = resolve
        self._fetch: queue.Queue[FleetEntry | None] = queue.Queue()
        self._ready: queue.Queue[FleetEntry] = queue.Queue()
        self._pending: set[str] = set()  # adapter ids asked for and not yet loaded: a watcher may replay an entry
        self._thread: threading.Thread | None = None

    def request(self, entry: FleetEntry) -> bool:
        """Ask for `entry`'s adapter (any thread); False when this worker does not serve its base or it is asked."""
        if entry.base not in self.bases or entry.adapter_id in self._pending:
            return False
        self._pending.add(entry.adapter_id)
        if self._thread is None:
            self._thread = threading.Thread(target=self._fetch_loop, name="adapter-preload", daemon=True)
            self._thread.start()
        self._fetch.put(entry)
        return True

    def _fetch_loop(self) -> None:
        while (entry := self._fetch.get()) is not None:
            t0 = time.perf_counter()
            if self._fetch_one(entry):
                log.info("adapter %s fetched for preload in %.2fs", entry.adapter_id, time.perf_counter() - t0)
                self._ready.put(entry)
            else:  # refused or failed: its first request loads it (or fails) as usual
                self._pending.discard(entry.adapter_id)

    def _fetch_one(self, entry: FleetEntry) -> bool:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                self.resolve(entry.adapter_uri)
                return True
            except AdapterUnavailable as exc:  # never loadable here: no point in trying again
                log.warning("preloading adapter %s refused: %s", entry.adapter_id, exc)
                return False
            except Exception as exc:
                log.warning("preloading adapter %s from %s failed (attempt %d of %d): %r", entry.adapter_id,
                            entry.adapter_uri, attempt, ATTEMPTS, exc)
                if attempt < ATTEMPTS:
                    time.sleep(RETRY_PAUSE_S * attempt)  # back off before the next try
        return False

    def run_pending(self, caches: Mapping[str, AdapterCache]) -> bool:
        """Load the fetched adapters into their base's cache (main thread, between batches); True when any was."""
        changed = False
        while True:
            try:
                entry = self._ready.get_nowait()
            except queue.Empty:
                return changed
            self._pending.discard(entry.adapter_id)
            cache = caches.get(entry.base)
            if cache is None:  # an engine base: its lane preloads
                continue
            t0 = time.perf_counter()
            try:
                source = cache.preload(entry.adapter_id, entry.adapter_uri)
            except Exception as exc:
                log.warning("preloading adapter %s on %s failed: %s", entry.adapter_id, entry.base, exc)
                continue
            changed = True
            log.info("adapter %s preloaded on %s from %s in %.2fs", entry.adapter_id, entry.base, source,
                     time.perf_counter() - t0)

    def close(self) -> None:
        self._fetch.put(None)


async def preload_engine(adapters: EngineAdapters, entry: FleetEntry) -> None:
    """Load a staged adapter on an engine (on the loop; the engine's cache resolves the URI in a thread)."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            epoch = await adapters.acquire(entry.adapter_id, entry.adapter_uri)
        except AdapterUnavailable as exc:
            log.warning("preloading adapter %s on %s refused: %s", entry.adapter_id, entry.base, exc)
            return
        except Exception as exc:
            log.warning("preloading adapter %s on %s failed (attempt %d of %d): %r", entry.adapter_id, entry.base,
                        attempt, ATTEMPTS, exc)
            if attempt < ATTEMPTS:
                await asyncio.sleep(RETRY_PAUSE_S * attempt)  # back off before the next try
            continue
        adapters.release(entry.adapter_id, epoch)
        log.info("adapter %s preloaded on the engine of %s", entry.adapter_id, entry.base)
        return
