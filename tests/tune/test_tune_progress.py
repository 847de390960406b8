"""`lorafleet tune` says which profile it measures, i of at most n, before each one (15 s or more apiece)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lorafleet.core.config import ServingProfile
from lorafleet.tune import sweep
from lorafleet.tune.analysis import ProfileResult
from lorafleet.tune.config import TuneConfig
from lorafleet.tune.kinds.retrieval import kind as retrieval
from lorafleet.tune.source import TuneSource


class _FakeSweeper:
    """Pure logic of the staged sweep: throughput from the profile, no cluster (the real one is batching.Sweeper)."""

    def __init__(self, source: TuneSource, cfg: TuneConfig, work_dir: Path, say: object) -> None:
        self.baseline_rps = 10.0
        self.open_rates = [5.0]

    def start(self, profile: ServingProfile) -> None: ...

    def apply(self, profile: ServingProfile) -> float:
        return 0.0

    def stop(self) -> None: ...

    def measure(self, profile: ServingProfile, phase: str, restart_s: float) -> ProfileResult:
        rps = 10.0 + profile.max_batch_items
        return ProfileResult(profile=profile, phase=phase, throughput_rps=rps, p50_ms=5.0, p99_ms=10.0,
                             peak_rss_mb=100.0, points=[{"level": 5.0}])


def test_each_profile_is_announced_as_i_of_at_most_n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retrieval, "Sweeper", _FakeSweeper)
    cfg = TuneConfig(items_grid=[1, 8], wait_grid=[0.0], inflight_grid=[], tokens_per_item_grid=[], warmup_s=0)
    lines: list[str] = []
    source = TuneSource(tmp_path / "adapter", "/models/tiny", "tiny", None, "x")
    result = sweep.run_tune(source, cfg, tmp_path / "out", say=lines.append)

    n = len(result.results)
    announced = [m.groups() for ln in lines if (m := re.match(r"^  profile (\d+)/≤(\d+) \((\w+)\): ", ln))]
    assert [int(i) for i, _, _ in announced] == list(range(1, n + 1)), lines
    assert {int(top) for _, top, _ in announced} == {4}  # baseline + 2 batch sizes + 1 wait window
    assert announced[0][2] == "baseline"
    done = [ln for ln in lines if re.match(r"^  \[ ?\d+/4\] items", ln)]
    assert len(done) == n  # each measured profile reports as i/n too


class _FakeGenerativeSweeper:
    """Pure logic of the generative sweep: throughput from the options, no engine (the real one restarts vLLM)."""

    def __init__(self, source: TuneSource, cfg: object, work_dir: Path, say: object) -> None:
        self.fixed = {"max_model_len": 2048, "max_lora_rank": 8}
        self.precision = "fp32"  # no dev set here: the precision guard keeps fp32 and generates nothing

    def start(self, options: dict) -> None: ...

    def apply(self, options: dict) -> float:
        return 0.0

    def stop(self) -> None: ...

    def measure(self, options: dict, phase: str, restart_s: float) -> object:
        from lorafleet.tune.kinds.generation.result import GenerativeResult

        return GenerativeResult(options=options, phase=phase, tokens_per_s=float(options.get("max_num_seqs", 1)),
                                ttft_p50_ms=5.0, ttft_p99_ms=10.0, itl_p50_ms=1.0, itl_p99_ms=2.0, peak_rss_mb=100.0)


def test_each_generative_profile_is_announced_as_i_of_at_most_n(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafleet.tune.config import GenerativeTuneConfig
    from lorafleet.tune.kinds.generation import kind as generative

    monkeypatch.setattr(generative, "GenerativeSweeper", _FakeGenerativeSweeper)
    cfg = GenerativeTuneConfig(seqs_grid=[8, 16], batched_tokens_grid=[512], slots_grid=[1.0], adapters=1,
                               plateau_gain=10.0, device="cpu")
    lines: list[str] = []
    source = TuneSource(tmp_path / "adapter", "/models/tiny", "tiny", None, "x")
    result = generative.run_generative_tune(source, cfg, tmp_path / "out", say=lines.append)

    n = len(result.results)
    announced = [m.groups() for ln in lines if (m := re.match(r"^  profile (\d+)/≤(\d+) \((\w+)\): ", ln))]
    assert [int(i) for i, _, _ in announced] == list(range(1, n + 1)), lines
    # baseline + 2 max_num_seqs + 1 batched-tokens + 1 KV-cache size + 1 slots share; one adapter: no cache stages
    assert {int(top) for _, top, _ in announced} == {6}
    assert announced[0][2] == "baseline"
    assert len([ln for ln in lines if re.match(r"^  \[ ?\d+/6\] ", ln)]) == n  # each measured one reports i/n too
