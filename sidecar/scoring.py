"""A score batch on a batch runtime (a cross-encoder), in the worker's main thread.

Each score task is one chunk of a rerank request: a query and up to a few dozen documents. The pairs
of every task in the batch are flattened and cut into runtime calls under the batch's token budget
(`max_batch_tokens`, padded: pairs × longest pair), shortest pairs first, so many small requests share
one forward pass and a long chunk does not pad everyone else's. Every pair of a chunk is estimated at
the chunk's longest (`Task.tokens` / documents), what the gateway counted.

A mixed batch (tasks of several adapters of one base, formed when the runtime computes them together) passes
each pair's adapter along (`Runtime.score_mixed`), so one call serves pairs of many adapters.

A call that fails is retried task by task, so one bad chunk (or an OOM on a large call) fails only
itself. A runtime that does not declare `score` refuses the task (`invalid_request`), never retried; so does a
cross-encoder whose score head was drawn at load (`CrossEncoderRuntime.trained_head` False) for a task of the bare
base (no adapter): its scores would rank at chance. The gateway refuses those itself (409) when it can read the
checkpoint; this is the same decision where the model is loaded, for the bases the gateway cannot read.
"""

from __future__ import annotations

import logging

import numpy as np

from lorafleet.core.wire import SCORE, ScoreParams
from lorafleet.models.checkpoints import untrained_head_message
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.batcher import Batch
from lorafleet.sidecar.ce_runtime import CrossEncoderRuntime
from lorafleet.sidecar.runtime import Runtime
from lorafleet.sidecar.settle import Outcome, Scores

log = logging.getLogger(__name__)

Pair = tuple[str, str]


def cut_pairs(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of the pairs per runtime call: shortest first, each call's padded size (count × longest) within
    `budget`; a pair longer than the whole budget goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    calls: list[list[int]] = []
    current: list[int] = []
    for i in order:
        n = max(lengths[i], 1)
        if current and (len(current) + 1) * n > budget:
            calls.append(current)
            current = []
        current.append(i)
    if current:
        calls.append(current)
    return calls


def _scores(runtime: Runtime, pairs: list[Pair], lengths: list[int], budget: int,
            adapters: str | list[str | None] | None) -> np.ndarray:
    """`adapters`: the batch's one adapter, or one per pair (a mixed batch)."""
    out = np.empty(len(pairs), dtype=np.float32)
    for call in cut_pairs(lengths, budget):
        chunk = [pairs[i] for i in call]
        if isinstance(adapters, list):
            got = runtime.score_mixed(chunk, [adapters[i] for i in call])
        else:
            got = runtime.score(chunk, adapters)
        got = np.asarray(got, dtype=np.float32)
        if got.shape != (len(call),):
            raise RuntimeError(f"runtime returned shape {got.shape} for {len(call)} pairs")
        out[call] = got
    return out


def _bare_refused(runtime: Runtime, batch: Batch, live: list[int]) -> set[int]:
    """The tasks of `live` that ask the bare base of a cross-encoder whose head was drawn at load."""
    if not isinstance(runtime, CrossEncoderRuntime) or runtime.trained_head is not False:
        return set()
    return {i for i in live if (batch.items[i].task.adapter if batch.mixed else batch.adapter) is None}


def score_batch(runtime: Runtime, batch: Batch, live: list[int]) -> list[Outcome]:
    """One Outcome per index in `live` (the batch's tasks still worth computing), in order."""
    if SCORE not in runtime.capabilities:
        return [Outcome(Situation.INVALID, message=f"base {batch.base!r} does not score (a {type(runtime).__name__})")
                for _ in live]
    refused = _bare_refused(runtime, batch, live)
    if refused:
        rest = [i for i in live if i not in refused]
        done = dict(zip(rest, score_batch(runtime, batch, rest), strict=True)) if rest else {}
        message = untrained_head_message(batch.base)
        return [done[i] if i in done else Outcome(Situation.INVALID, message=message) for i in live]
    tasks = [batch.items[i].task for i in live]
    docs = [ScoreParams.of(t).documents for t in tasks]  # checked at intake
    pairs: list[Pair] = []
    lengths: list[int] = []
    spans: list[tuple[int, int]] = []
    for task, ds in zip(tasks, docs, strict=True):
        per_pair = max(task.tokens // len(ds), 1)
        spans.append((len(pairs), len(pairs) + len(ds)))
        pairs.extend((task.text, d) for d in ds)
        lengths.extend([per_pair] * len(ds))
    budget = batch.profile.max_batch_tokens
    per_task = [t.adapter if batch.mixed else batch.adapter for t in tasks]
    adapters: str | list[str | None] | None = batch.adapter
    if batch.mixed:
        adapters = [a for a, (lo, hi) in zip(per_task, spans, strict=True) for _ in range(hi - lo)]
    try:
        scores = _scores(runtime, pairs, lengths, budget, adapters)
        return [Outcome(Situation.OK, scores=Scores(np.ascontiguousarray(scores[a:b], dtype="<f4").tobytes()))
                for a, b in spans]
    except Exception as exc:
        if len(tasks) == 1:
            log.warning("score failed for one task: %r", exc)
            return [Outcome(Situation.RUNTIME_FAILED, message=f"{type(exc).__name__}: {exc}")]
        log.warning("score batch of %d tasks failed (%r); retrying them one by one", len(tasks), exc)
    out: list[Outcome] = []
    for (a, b), adapter in zip(spans, per_task, strict=True):
        try:
            s = _scores(runtime, pairs[a:b], lengths[a:b], budget, adapter)
            out.append(Outcome(Situation.OK, scores=Scores(np.ascontiguousarray(s, dtype="<f4").tobytes())))
        except Exception as exc:
            out.append(Outcome(Situation.RUNTIME_FAILED, message=f"{type(exc).__name__}: {exc}"))
    return out
