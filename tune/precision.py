"""Precision as an axis of the sweep: the quality guard every candidate precision must pass before it is measured.

The guard runs once per precision (not per serving profile), in this process, on the same runtime plugin the
worker serves with, the base at that precision and the adapter loaded: it encodes the bundle's dev set (queries
and corpus) and scores nDCG@10 (`lorafleet.core.metrics.ndcg_at_k`), and compares every vector with fp32's (min and
mean cosine). A precision qualifies when the relative loss of nDCG@10 stays within `precision_max_loss` and the
min cosine at or above `precision_min_cosine`. Without a dev set only the cosine check runs, on the fixed probe
sentences of `lorafleet.models.precision`. A precision the runtime cannot run, or that cannot take the adapter (int8's
dynamic quantisation), is disqualified with that reason; disqualified precisions stay in the report's table.

What the nDCG@10 measures (issue 39): the pipeline's dev set (`pipeline.dev_set_for`) holds each section's first
chunk, ≤ 400 sections, ≤ 200 queries; the guard ranks those by cosine. It measures how far a precision moves that
ranking against fp32's on the same texts (only the relative loss is used), not the report's MaxP nDCG@10 over every
chunk of the full corpus, whose absolute values differ. The generative sweep's guard is generation_guard.py.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lorafleet.core.metrics import ndcg_at_k
from lorafleet.models.precision import FP32, PRECISIONS, PROBE_SENTENCES, SPEED_ORDER

# Texts encoded for the cosine check at most (the dev set's queries first, then its corpus).
MAX_AGREEMENT_TEXTS = 2048
K = 10

Encode = Callable[[list[str]], np.ndarray]
# precision → an encoder of texts through the served runtime at that precision (raises when it cannot run).
EncoderFactory = Callable[[str], Encode]


@dataclass(frozen=True, slots=True)
class DevSet:
    """A retrieval dev set: query and corpus texts by id, and graded relevance per query."""

    queries: dict[str, str]
    corpus: dict[str, str]
    qrels: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PrecisionQuality:
    """The guard's verdict on one precision; fp32 (the reference) always qualifies."""

    precision: str
    qualified: bool
    reason: str
    ndcg: float | None = None  # the dev metric (nDCG@10; generative: ROUGE-L), None: no dev set, or not measured
    loss: float | None = None  # relative loss of the dev metric against fp32 (negative: a gain)
    min_cosine: float | None = None
    mean_cosine: float | None = None
    metric: str = "ndcg@10"  # what `ndcg` holds (the generative guard's: rouge_l, generation_guard.py)
    agreement: float | None = None  # generative: the share of dev answers identical to fp32's

    def row(self) -> dict[str, Any]:
        row = {"precision": self.precision, "qualified": self.qualified, "quality_reason": self.reason,
               f"dev_{self.metric}": _r(self.ndcg), "quality_loss": _r(self.loss)}
        if self.metric == "ndcg@10":
            return {**row, "min_cosine": _r(self.min_cosine), "mean_cosine": _r(self.mean_cosine)}
        return {**row, "equal_to_fp32": _r(self.agreement)}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def relative_loss(reference: float, value: float) -> float:
    """(reference − value) / reference; 0 when both are 0, infinite when only the reference scores."""
    if reference > 0:
        return (reference - value) / reference
    return 0.0 if value >= reference else math.inf


def judge(precision: str, *, ref_ndcg: float | None, ndcg: float | None, min_cos: float, mean_cos: float,
          max_loss: float, min_cosine: float) -> PrecisionQuality:
    """Qualified when the relative nDCG@10 loss is within `max_loss` (where there is a dev set) and the min cosine
    to fp32 at least `min_cosine`; the reason names the check that failed, or both figures when it passes."""
    loss = relative_loss(ref_ndcg, ndcg) if ref_ndcg is not None and ndcg is not None else None
    fails: list[str] = []
    if loss is not None and loss > max_loss:
        fails.append(f"nDCG@10 loss {loss:.2%} > {max_loss:.2%}")
    if min_cos < min_cosine:
        fails.append(f"min cosine {min_cos:.5f} < {min_cosine}")
    if fails:
        reason = "; ".join(fails)
    else:
        reason = (f"nDCG@10 loss {loss:.2%} ≤ {max_loss:.2%}, " if loss is not None else "no dev set: ") \
            + f"min cosine {min_cos:.5f} ≥ {min_cosine}"
    return PrecisionQuality(precision, not fails, reason, ndcg, loss, min_cos, mean_cos)


def candidate_precisions(wanted: list[str] | str, supported: Iterable[str]) -> tuple[list[str], list[PrecisionQuality]]:
    """What the guard measures (fp32 first, then the others fastest first) and what is rejected up front: `auto`
    is every precision the runtime supports here; a named one it does not support is disqualified with why."""
    have = set(supported) | {FP32}
    asked = [p for p in PRECISIONS if p in have] if wanted == "auto" else list(dict.fromkeys([FP32, *wanted]))
    order = [FP32, *SPEED_ORDER]
    measure = sorted((p for p in asked if p in have), key=lambda p: order.index(p) if p in order else len(order))
    rejected = [PrecisionQuality(p, False, f"not supported by the runtime here (supports {', '.join(sorted(have))})")
                for p in asked if p not in have]
    return measure, rejected


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    num = (a64 * b64).sum(axis=1)
    return num / np.maximum(np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1), 1e-12)


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def dev_ndcg(dev: DevSet, vectors: np.ndarray, k: int = K) -> float:
    """nDCG@k of ranking the corpus by cosine to each query; `vectors` holds the queries' rows, then the corpus'."""
    qids, dids = list(dev.queries), list(dev.corpus)
    q, d = _unit(vectors[: len(qids)]), _unit(vectors[len(qids): len(qids) + len(dids)])
    sims = q @ d.T
    top = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    ranked = {qid: [dids[j] for j in top[i]] for i, qid in enumerate(qids)}
    return ndcg_at_k(ranked, dev.qrels, k)


def guard(precisions: list[str], encoder_at: EncoderFactory, dev: DevSet | None, *, max_loss: float,
          min_cosine: float) -> list[PrecisionQuality]:
    """The verdict on each of `precisions` (fp32 first), each encoded once. A precision whose encoder fails (the
    runtime cannot run it, or it takes no adapter) is disqualified with the error as the reason."""
    texts = [*dev.queries.values(), *dev.corpus.values()] if dev is not None else list(PROBE_SENTENCES)
    agreement = min(len(texts), MAX_AGREEMENT_TEXTS)
    reference = np.asarray(encoder_at(FP32)(texts))
    ref_ndcg = dev_ndcg(dev, reference) if dev is not None else None
    out = [PrecisionQuality(FP32, True, "the reference", ref_ndcg, 0.0 if dev is not None else None, 1.0, 1.0)]
    for p in precisions:
        if p == FP32:
            continue
        try:
            vectors = np.asarray(encoder_at(p)(texts))
        except Exception as exc:  # why it cannot serve: shown in the table, never fatal to the sweep
            out.append(PrecisionQuality(p, False, f"cannot serve the adapter: {type(exc).__name__}: {exc}"))
            continue
        cos = _cosines(vectors[:agreement], reference[:agreement])
        out.append(judge(p, ref_ndcg=ref_ndcg, ndcg=dev_ndcg(dev, vectors) if dev is not None else None,
                         min_cos=float(cos.min()), mean_cos=float(cos.mean()), max_loss=max_loss,
                         min_cosine=min_cosine))
    return out


class RuntimeEncoder:
    """Encoders through the runtime plugin the worker serves with: the base at the precision, the adapter loaded
    (as served), one runtime at a time (the previous one is closed before the next loads; `close` ends the last)."""

    def __init__(self, runtime_cls: Any, spec_at: Callable[[str], Any], adapter_dir: str, device: str,
                 adapter_id: str = "tuned") -> None:
        self.runtime_cls, self.spec_at, self.adapter_dir, self.device = runtime_cls, spec_at, adapter_dir, device
        self.adapter_id = adapter_id
        self.current: Any = None

    def __call__(self, precision: str) -> Encode:
        self.close()
        rt = self.current = self.runtime_cls(self.spec_at(precision), device=self.device)
        rt.load_adapter(self.adapter_id, self.adapter_dir)
        return lambda texts: rt.encode(texts, self.adapter_id)

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None
            gc.collect()


def run_guard(source: Any, cfg: Any, say: Callable[[str], None],
              encoder_factory: Callable[[list[str]], tuple[EncoderFactory, Callable[[], None]]] | None = None
              ) -> list[PrecisionQuality]:
    """The guard for a sweep of `source` (a TuneSource) under `cfg` (a TuneConfig): candidates from the runtime's
    supported precisions on the device, each judged once. Where even fp32 cannot be encoded here, the sweep
    stays at fp32 (the cluster's start reports what is wrong with the base)."""
    from lorafleet.core import plugins
    from lorafleet.core.config import BaseModelSpec
    from lorafleet.models.device import resolve_device

    def spec_at(precision: str) -> BaseModelSpec:
        return BaseModelSpec(name=source.base_name, source=source.base_source, revision=source.base_revision,
                             precision=precision)

    try:
        device = resolve_device(cfg.device)
        runtime_cls = plugins.load(plugins.RUNTIMES, spec_at(FP32).runtime)
        declared = getattr(runtime_cls, "precisions", None)
        supported = declared(device) if declared is not None else frozenset({FP32})
    except Exception as exc:
        say(f"  precision: cannot ask the runtime what it supports ({type(exc).__name__}: {exc}); fp32 only")
        return [PrecisionQuality(FP32, True, "the reference")]
    measure, rejected = candidate_precisions(cfg.precisions, supported)
    if measure == [FP32] and not rejected:
        return [PrecisionQuality(FP32, True, "the reference (the only precision here)")]
    dev = getattr(source, "dev", None)
    say(f"  precision guard on {device}: {', '.join(measure)} against fp32 on "
        + (f"the dev set ({len(dev.queries)} queries, {len(dev.corpus)} documents)" if dev is not None
           else f"{len(PROBE_SENTENCES)} probe sentences (no dev set)"))
    if encoder_factory is not None:
        encoder_at, close = encoder_factory(measure)
    else:
        enc = RuntimeEncoder(runtime_cls, spec_at, str(source.adapter_dir), device)
        encoder_at, close = enc, enc.close
    try:
        verdicts = guard(measure, encoder_at, dev, max_loss=cfg.precision_max_loss,
                         min_cosine=cfg.precision_min_cosine)
    except Exception as exc:  # fp32 itself failed here
        say(f"  precision: the fp32 reference could not be encoded ({type(exc).__name__}: {exc}); fp32 only")
        return [PrecisionQuality(FP32, True, "the reference"), *rejected]
    finally:
        close()
    for v in [*verdicts, *rejected]:
        say(f"    {v.precision:>4}: {'qualifies' if v.qualified else 'disqualified'} — {v.reason}")
    return [*verdicts, *rejected]
