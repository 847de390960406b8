"""Issue 39, item 2: the generative sweep judges dev ROUGE-L at each precision it may serve, refuses one below the
guard, measures at the judged one and records it. Pure logic (a fake sweeper answers the dev prompts: the real one
goes through the tuning cluster's gateway, worker and vLLM engine, which CI does not start)."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from lorafleet.tune.config import GenerativeTuneConfig
from lorafleet.tune.generation_guard import GenerationDev, chosen_precision, generation_guard, judge_generation
from lorafleet.tune.kinds.generation import kind as generative
from lorafleet.tune.kinds.generation.result import GenerativeResult
from lorafleet.tune.source import TuneSource

REFS = ("Rücktritt vom Vertrag", "Kaufvertrag", "Mietminderung", "Schadensersatz")


def _overlap(answers: Sequence[str], refs: Sequence[str]) -> float:
    """A stand-in for the gate's ROUGE-L: the share of exact answers."""
    return sum(a == r for a, r in zip(answers, refs, strict=True)) / len(refs)


DEV = GenerationDev(tuple([{"role": "user", "content": f"§ {i}"}] for i in range(len(REFS))), REFS, 16, _overlap)


def test_a_precision_within_the_guard_qualifies_one_below_is_refused() -> None:
    ok = judge_generation("bf16", ref_score=0.50, score=0.4990, agreement=0.9, max_loss=0.005)
    assert ok.qualified and ok.loss == pytest.approx(0.002) and "90% of answers equal fp32's" in ok.reason
    bad = judge_generation("bf16", ref_score=0.50, score=0.49, agreement=0.9, max_loss=0.005)
    assert not bad.qualified and "loss 2.00% > 0.50%" in bad.reason
    assert bad.row()["dev_rouge_l"] == 0.49 and bad.row()["equal_to_fp32"] == 0.9
    unmeasured = judge_generation("bf16", ref_score=None, score=None, agreement=None, max_loss=1.0)
    assert not unmeasured.qualified and "only fp32" in unmeasured.reason  # nothing measured it: never served


def test_the_guard_generates_once_per_precision_and_keeps_fp32_when_bf16_loses() -> None:
    calls: list[str] = []

    def generator_at(precision: str):  # type: ignore[no-untyped-def]
        calls.append(precision)
        wrong = 1 if precision == "bf16" else 0  # bf16 gets one heading of four wrong
        return lambda prompts: [("x" if i < wrong else r) for i, r in enumerate(REFS[: len(prompts)])]

    quality = generation_guard(["fp32", "bf16"], generator_at, DEV, max_loss=0.005)
    assert calls == ["fp32", "bf16"]
    assert [(q.precision, q.qualified) for q in quality] == [("fp32", True), ("bf16", False)]
    assert quality[1].agreement == 0.75 and chosen_precision(quality) == "fp32"
    no_dev = generation_guard(["fp32", "bf16"], generator_at, None, max_loss=0.005)
    assert calls == ["fp32", "bf16"] and chosen_precision(no_dev) == "fp32"  # no dev set: nothing generated


class _GuardSweeper:
    """The staged sweep's fake (tokens/s from the options) that also answers dev prompts; bf16 answers `wrong_at_bf16`
    of them wrongly. Records the precision each profile was measured at."""

    wrong_at_bf16 = 1

    def __init__(self, source: TuneSource, cfg: GenerativeTuneConfig, work_dir: Path, say: object) -> None:
        self.fixed = {"max_model_len": 256, "max_lora_rank": 8}
        self.precision = "fp32"
        self.measured_at: list[str] = []
        _GuardSweeper.last = self  # type: ignore[attr-defined]

    def start(self, options: dict[str, object]) -> None: ...

    def apply(self, options: dict[str, object]) -> float:
        return 0.0

    def stop(self) -> None: ...

    def generate(self, prompts: list[object], max_tokens: int) -> list[str]:
        wrong = self.wrong_at_bf16 if self.precision == "bf16" else 0
        return [("x" if i < wrong else r) for i, r in enumerate(REFS[: len(prompts)])]

    def measure(self, options: dict[str, object], phase: str, restart_s: float) -> GenerativeResult:
        self.measured_at.append(self.precision)
        return GenerativeResult(dict(options), phase, 100.0 + int(options["max_num_seqs"]), 10.0, 100.0, 5.0, 9.0,  # type: ignore[call-overload]
                                400.0)


@pytest.mark.parametrize(("wrong", "judged"), [(1, "fp32"), (0, "bf16")])
def test_the_sweep_measures_and_records_the_judged_precision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             wrong: int, judged: str) -> None:
    monkeypatch.setattr(generative, "GenerativeSweeper", _GuardSweeper)
    monkeypatch.setattr(_GuardSweeper, "wrong_at_bf16", wrong)
    cfg = GenerativeTuneConfig(adapters=1, seqs_grid=[8], batched_tokens_grid=[], kv_cache_gib_grid=[],
                               slots_grid=[], warmup_s=0, precisions=["fp32", "bf16"], device="cpu")
    source = TuneSource(tmp_path / "adapter", "/models/tiny", "tiny", None, "x", generation=DEV)
    result = generative.run_generative_tune(source, cfg, tmp_path / "out", say=lambda _: None)
    assert result.profile.precision == judged
    assert set(_GuardSweeper.last.measured_at) == {judged}  # type: ignore[attr-defined]  # every profile at it
    with open(result.files["precisions"]) as fh:
        rows = {r["precision"]: r for r in csv.DictReader(fh)}
    assert rows["fp32"]["qualified"] == "True" and rows["bf16"]["qualified"] == str(judged == "bf16")
    assert json.loads(result.files["json"].read_text())["precision"] == judged
    assert f"judged at {judged}" in result.files["profile"].read_text()
