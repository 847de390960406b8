"""A generate batch on a batch runtime (e.g. transformers), in the worker's main thread.

Text deltas go to each task's stream on the event loop (`TextOut.post`, through `call_soon_threadsafe`)
as the runtime produces them; whether a sequence must stop (its client went away, its deadline
passed) is read from the same stream. A runtime that refuses an input (`RequestRefused`, e.g. a
prompt over its context) refuses it before generating anything, so the batch is then run again one
task at a time to answer only the bad one. Any other failure fails the whole batch (retried): a
batch that failed half-way may have streamed text, and a redelivery is what a gateway knows how to
reconcile.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from lorafleet.core.deadlines import local_deadline
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.batcher import Batch, Pulled
from lorafleet.sidecar.runtime import ABORTED, Generated, GenerateInput, RequestRefused, Runtime
from lorafleet.sidecar.settle import Outcome, Text

log = logging.getLogger(__name__)


class ThreadSink:
    """`runtime.TokenSink` for the main thread: deltas are posted to the loop, stops are read from the streams."""

    def __init__(self, side: Any, items: list[Pulled]) -> None:
        self.side = side
        self.outs = [side.text_out(p.task.id) if side is not None else None for p in items]
        self.deadlines = [local_deadline(p.task) for p in items]

    def delta(self, i: int, text: str) -> None:
        out = self.outs[i]
        if out is not None and text:
            self.side.post(out.post, text)

    def stopped(self, i: int) -> bool:
        out = self.outs[i]
        return (out is not None and out.aborted) or time.time() >= self.deadlines[i]


def generate_batch(runtime: Runtime, batch: Batch, live: list[int], side: Any) -> list[Outcome]:
    """One Outcome per index in `live` (the batch's tasks still worth computing)."""
    items = [batch.items[i] for i in live]
    try:
        return _run(runtime, items, batch.adapter, side)
    except RequestRefused as exc:
        if len(items) == 1:
            return [Outcome(Situation.INVALID, message=str(exc))]
        log.info("a batch of %d was refused (%s); running its tasks one by one", len(items), exc)
        return [_alone(runtime, p, batch.adapter, side) for p in items]
    except Exception as exc:
        log.warning("generate batch of %d failed: %r", len(items), exc, exc_info=True)
        return [Outcome(Situation.RUNTIME_FAILED, message=f"{type(exc).__name__}: {exc}") for _ in items]


def _alone(runtime: Runtime, item: Pulled, adapter: str | None, side: Any) -> Outcome:
    try:
        return _run(runtime, [item], adapter, side)[0]
    except RequestRefused as exc:
        return Outcome(Situation.INVALID, message=str(exc))
    except Exception as exc:
        return Outcome(Situation.RUNTIME_FAILED, message=f"{type(exc).__name__}: {exc}")


def _run(runtime: Runtime, items: list[Pulled], adapter: str | None, side: Any) -> list[Outcome]:
    inputs = [GenerateInput(p.task.text, p.params, p.task.id) for p in items if p.params is not None]
    if len(inputs) != len(items):
        raise RuntimeError("a generate task without parameters reached the runtime")
    results = runtime.generate(inputs, adapter, ThreadSink(side, items))
    if len(results) != len(items):
        raise RuntimeError(f"runtime returned {len(results)} results for {len(items)} inputs")
    return [_outcome(g, p) for g, p in zip(results, items, strict=True)]


def _outcome(g: Generated, p: Pulled) -> Outcome:
    if g.finish_reason != ABORTED:
        return Outcome(Situation.OK, text=Text(g))
    if time.time() >= local_deadline(p.task):
        return Outcome(Situation.DEADLINE, message="deadline passed while generating")
    return Outcome(Situation.CANCELLED, message="nobody waits for the text any more")
