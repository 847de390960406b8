"""The generative sweep's quality guard (issue 39): dev ROUGE-L at each precision the engine may serve.

The gate scores a generative specialist in float32; an engine serving it at bf16 answers differently (measured:
1 of 10 served answers differed from the scored ones). So before the engine options are swept, the specialist's
dev prompts are answered greedily through the tuning cluster's gateway, worker and engine (the served path), once
per candidate precision (the worker restarted at it), the adapter loaded, and scored with the gate's own scorer
(mean ROUGE-L of the cleaned answers). A precision qualifies when its relative loss against fp32's score stays
within `precision_max_loss` (the retrieval guard's margin, `tune/precision.py`); the table also shows the share of
answers identical to fp32's. The fastest qualifying precision is the one the sweep measures and the bundle records
(`BundleSpec.precision`); without a dev set only fp32, the gated precision, qualifies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lorafleet.models.precision import FP32, SPEED_ORDER
from lorafleet.tune.precision import PrecisionQuality, relative_loss

Messages = list[dict[str, str]]
Generate = Callable[[list[Messages]], list[str]]
# precision → a generator of answers through the served runtime at that precision (raises when it cannot run).
GeneratorFactory = Callable[[str], Generate]
METRIC = "rouge_l"


@dataclass(frozen=True, slots=True)
class GenerationDev:
    """A generative dev set: each prompt's messages (system and user turns, as the gate built them; the gateway
    renders the chat template), the references, the answer budget the gate decoded with, and the gate's scorer
    (answers, references → mean score; it cleans the answers as the gate does)."""

    prompts: tuple[Messages, ...]
    references: tuple[str, ...]
    max_tokens: int
    score: Callable[[Sequence[str], Sequence[str]], float]
    metric: str = METRIC


def judge_generation(precision: str, *, ref_score: float | None, score: float | None, agreement: float | None,
                     max_loss: float, metric: str = METRIC) -> PrecisionQuality:
    """Qualified when the relative loss of the dev score against fp32's is within `max_loss`; without a score
    (no dev set) a reduced precision never qualifies: nothing measured it."""
    if ref_score is None or score is None:
        return PrecisionQuality(precision, False, f"no dev set to score {metric} on: only fp32, the gated precision, "
                                "qualifies", metric=metric)
    loss = relative_loss(ref_score, score)
    ok = loss <= max_loss
    same = f", {agreement:.0%} of answers equal fp32's" if agreement is not None else ""
    reason = f"dev {metric} loss {loss:.2%} {'≤' if ok else '>'} {max_loss:.2%}{same}"
    return PrecisionQuality(precision, ok, reason, score, loss, metric=metric, agreement=agreement)


def generation_guard(precisions: list[str], generator_at: GeneratorFactory, dev: GenerationDev | None, *,
                     max_loss: float) -> list[PrecisionQuality]:
    """The verdict on each of `precisions` (fp32 first), each generated once. A precision whose engine fails is
    disqualified with the error as the reason; fp32 failing raises (the sweep cannot run either)."""
    if dev is None:
        return [PrecisionQuality(FP32, True, "the reference (no dev set)", metric=METRIC),
                *(judge_generation(p, ref_score=None, score=None, agreement=None, max_loss=max_loss)
                  for p in precisions if p != FP32)]
    prompts = list(dev.prompts)
    reference = generator_at(FP32)(prompts)
    ref_score = dev.score(reference, dev.references)
    out = [PrecisionQuality(FP32, True, "the reference", ref_score, 0.0, metric=dev.metric, agreement=1.0)]
    for p in precisions:
        if p == FP32:
            continue
        try:
            answers = generator_at(p)(prompts)
        except Exception as exc:  # why it cannot serve: shown in the table, never fatal to the sweep
            out.append(PrecisionQuality(p, False, f"cannot serve the adapter: {type(exc).__name__}: {exc}",
                                        metric=dev.metric))
            continue
        agreement = sum(a == b for a, b in zip(answers, reference, strict=True)) / max(len(prompts), 1)
        out.append(judge_generation(p, ref_score=ref_score, score=dev.score(answers, dev.references),
                                    agreement=agreement, max_loss=max_loss, metric=dev.metric))
    return out


def chosen_precision(quality: list[PrecisionQuality]) -> str:
    """The fastest qualifying precision (SPEED_ORDER), else fp32: what the sweep measures and the bundle records."""
    qualified = {q.precision for q in quality if q.qualified}
    return next((p for p in SPEED_ORDER if p in qualified), FP32)
