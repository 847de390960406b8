"""The main-thread side of a worker: one batch in, one outcome per task out.

A batch names one adapter (or none), or it is mixed: each task names its own adapter of the same base
and the runtime computes them in one forward pass (`Runtime.encode_mixed`). Either way the adapters a
batch needs are pinned in the base's adapter cache while it computes (`AdapterCache.use`), so a load
for one of them never evicts another; an adapter that fails to load fails only its own tasks, and one
that finds no room (every hot slot pinned by this batch) runs in a second pass of the same batch.

An adapter whose URI is still being fetched (a `models:` download and its sha256 checks, on a fetch
thread: `adapters.Fetches`) defers its tasks instead: they leave the batch, uncomputed and not failed,
the rest of the batch is computed and settled as usual, and the waiting rows go back to the NATS side
(`side.resume`) when the fetch ends, to come back as a batch of their own. Meanwhile this thread
computes every other batch, of any base. The waiting tasks stay held (kept alive) without a slot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.core.deadlines import local_deadline
from lorafleet.core.wire import GENERATE, SCORE
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.adapters import AdapterCache
from lorafleet.sidecar.batcher import Batch
from lorafleet.sidecar.generation import generate_batch
from lorafleet.sidecar.runtime import Runtime
from lorafleet.sidecar.scoring import score_batch
from lorafleet.sidecar.settle import Outcome

log = logging.getLogger(__name__)

Adapters = str | None | Sequence[str | None]  # one adapter for the whole call, or one per row (mixed)


class UriLookup(Protocol):
    def uri_for(self, adapter: str, task_uri: str | None) -> str | None:
        """Where to load `adapter` from (the worker's fleet view, else the task's URI)."""


def load_failure(adapter: str, exc: BaseException) -> Outcome:
    if isinstance(exc, AdapterUnavailable):
        return Outcome(Situation.ADAPTER_UNAVAILABLE, message=str(exc))
    return Outcome(Situation.ADAPTER_FAILED, message=f"{type(exc).__name__}: {exc}")


class _Once:
    """Runs `fn` on the first call only: the done-callback of every fetch a batch waits for (any thread)."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._called = False

    def __call__(self, _future: object = None) -> None:
        with self._lock:
            if self._called:
                return
            self._called = True
        self._fn()


class Computer:
    """Runs batches on the (batch) runtimes; main thread only."""

    def __init__(self, runtimes: dict[str, Runtime], caches: dict[str, AdapterCache], lookup: UriLookup,
                 side: Any = None) -> None:
        self.runtimes = runtimes
        self.caches = caches
        self.lookup = lookup
        self.side = side  # the NATS side: generated text streams there; rows that waited for a fetch go back (resume)
        self.adapters_changed = False
        self.last_encode: tuple[int, float] | None = None  # (items, seconds) of the last batch computed whole
        self.waiting: Batch | None = None  # the last run's rows that wait for an adapter fetch

    def run(self, batch: Batch) -> tuple[list[Outcome], float]:
        """One outcome per task of `batch`, in order, and the wall-clock time compute began.

        Rows whose adapter is still being fetched leave `batch` first (its items shrink to the rows answered
        now): they are `self.waiting`, handed to `side.resume` once a fetch they wait for ends."""
        started = time.time()
        self.last_encode = None
        self.waiting = None
        outcomes: list[Outcome | None] = [None] * len(batch.items)
        pending: list[int] = []
        for i, item in enumerate(batch.items):
            if local_deadline(item.task) <= started:
                outcomes[i] = Outcome(Situation.DEADLINE, message="deadline passed before compute")
            else:
                pending.append(i)
        fetching: dict[str, Future[Path]] = {}
        passes = 0
        while pending:
            passes += 1
            pending = self._pass(batch, pending, outcomes, fetching, whole=passes == 1)
        if fetching:
            self._defer(batch, outcomes, fetching)
        return [o for o in outcomes if o is not None], started

    def _defer(self, batch: Batch, outcomes: list[Outcome | None], fetching: dict[str, Future[Path]]) -> None:
        """The rows left without an outcome wait for a fetch: out of `batch`, back to the side when one ends."""
        waiting = replace(batch, items=[p for p, o in zip(batch.items, outcomes, strict=True) if o is None], seq=0)
        batch.items = [p for p, o in zip(batch.items, outcomes, strict=True) if o is not None]
        self.waiting = waiting
        log.info("%d task(s) of %s wait for adapter(s) %s to be fetched; other batches compute meanwhile",
                 len(waiting), batch.base, ", ".join(sorted(fetching)))
        side = self.side
        if side is not None:
            resume = _Once(lambda: side.resume(waiting))
            for future in fetching.values():
                future.add_done_callback(resume)  # at once when it has ended already

    def _adapter_of(self, batch: Batch, i: int) -> str | None:
        return batch.items[i].task.adapter if batch.mixed else batch.adapter

    def _pass(self, batch: Batch, pending: list[int], outcomes: list[Outcome | None],
              fetching: dict[str, Future[Path]], whole: bool) -> list[int]:
        """Compute what can run now; returns the indices deferred to another pass (no room in the cache).
        Rows whose adapter is being fetched get no outcome; their fetches are added to `fetching`."""
        wanted: dict[str, str | None] = {}
        for i in pending:
            adapter = self._adapter_of(batch, i)
            if adapter is not None and adapter not in wanted:
                wanted[adapter] = self._uri(batch, adapter)
        cache = self.caches[batch.base]
        t0 = time.perf_counter()
        with cache.use(wanted) as use:
            if use.loaded_now:
                self.adapters_changed = True
                log.info("adapter(s) %s loaded on %s in %.2fs", ", ".join(sorted(use.loaded_now)), batch.base,
                         time.perf_counter() - t0)
            for adapter, exc in use.failed.items():
                if isinstance(exc, AdapterUnavailable):
                    log.warning("adapter %s unavailable: %s", adapter, exc)
                else:
                    log.warning("adapter %s failed to load (will retry): %r", adapter, exc)
            now: list[int] = []
            later: list[int] = []
            for i in pending:
                adapter = self._adapter_of(batch, i)
                if adapter is not None and adapter in use.failed:
                    outcomes[i] = load_failure(adapter, use.failed[adapter])
                elif adapter is not None and adapter in use.fetching:
                    fetching[adapter] = use.fetching[adapter]
                elif adapter is None or adapter in use.ready:
                    now.append(i)
                else:
                    later.append(i)
            if not now and later:
                # The cache's progress guarantee makes this unreachable; never spin on it.
                for i in later:
                    outcomes[i] = Outcome(Situation.ADAPTER_FAILED, message="no room in the adapter cache")
                return []
            if now:
                self._compute(batch, now, outcomes, whole and not later and not use.failed and not use.fetching)
        return later

    def _uri(self, batch: Batch, adapter: str) -> str | None:
        task_uri = next((p.task.adapter_uri for p in batch.items
                         if p.task.adapter == adapter and p.task.adapter_uri), None)
        return self.lookup.uri_for(adapter, task_uri)

    def _compute(self, batch: Batch, idx: list[int], outcomes: list[Outcome | None], whole: bool) -> None:
        runtime = self.runtimes[batch.base]
        t0 = time.perf_counter()
        if batch.op == GENERATE:
            generated = generate_batch(runtime, batch, idx, self.side)
            for i, outcome in zip(idx, generated, strict=True):
                outcomes[i] = outcome
            if whole and all(o.situation is Situation.OK for o in generated):
                self.last_encode = (len(idx), time.perf_counter() - t0)
            return
        if batch.op == SCORE:
            scored = score_batch(runtime, batch, idx)
            for i, outcome in zip(idx, scored, strict=True):
                outcomes[i] = outcome
            if whole and all(o.situation is Situation.OK for o in scored):
                self.last_encode = (len(idx), time.perf_counter() - t0)
            return
        texts = [batch.items[i].task.text for i in idx]
        adapters: Adapters = [self._adapter_of(batch, i) for i in idx] if batch.mixed else batch.adapter
        vectors = self._encode_split(runtime, texts, adapters)
        if whole and all(isinstance(v, bytes) for v in vectors):  # a bisected batch's time says nothing of its size
            self.last_encode = (len(idx), time.perf_counter() - t0)
        for i, v in zip(idx, vectors, strict=True):
            outcomes[i] = Outcome(Situation.OK, vector=v) if isinstance(v, bytes) else \
                Outcome(Situation.RUNTIME_FAILED, message=f"{type(v).__name__}: {v}")

    def _encode_split(self, runtime: Runtime, texts: list[str], adapters: Adapters) -> list[bytes | Exception]:
        """Encode; when a batch fails, bisect it so one bad input (or an OOM) does not fail its neighbours."""
        try:
            if isinstance(adapters, str) or adapters is None:
                arr = runtime.encode(texts, adapters)
            else:
                arr = runtime.encode_mixed(texts, list(adapters))
            if arr.shape != (len(texts), runtime.dim):
                raise RuntimeError(f"runtime returned shape {arr.shape}, expected {(len(texts), runtime.dim)}")
            arr = np.ascontiguousarray(arr, dtype="<f4")
            return [row.tobytes() for row in arr]
        except Exception as exc:
            if len(texts) == 1:
                log.warning("encode failed for one input: %s", exc)
                return [exc]
            log.warning("batch of %d failed (%s); retrying as halves", len(texts), exc)
            mid = len(texts) // 2
            left = adapters if isinstance(adapters, str) or adapters is None else adapters[:mid]
            right = adapters if isinstance(adapters, str) or adapters is None else adapters[mid:]
            return self._encode_split(runtime, texts[:mid], left) + self._encode_split(runtime, texts[mid:], right)

    def snapshot(self) -> dict[str, list[str]]:
        return {base: cache.loaded() for base, cache in self.caches.items()}
