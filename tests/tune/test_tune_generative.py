"""The generative sweep's pure parts: which adapters it applies to, and the recommendation under a TTFT objective."""

from __future__ import annotations

import json
from pathlib import Path

from lorafleet.tune.generative import GenerativeResult, is_generative, recommend
from lorafleet.tune.source import TuneSource


def _result(seqs: int, tps: float, ttft_p99: float | None, errors: int = 0, rss: float = 500.0) -> GenerativeResult:
    return GenerativeResult({"max_num_seqs": seqs}, "seqs", tps, 10.0, ttft_p99, 30.0, 60.0, rss, errors)


def test_recommends_the_fastest_profile_within_the_objective() -> None:
    results = [_result(8, 100, 300), _result(16, 150, 900), _result(32, 170, 2500), _result(64, 200, 100, errors=1)]
    best, meets, reason = recommend(results, 1000.0, None)  # type: ignore[misc]
    assert best.options == {"max_num_seqs": 16} and meets and "≤ 1000 ms" in reason
    best, meets, _ = recommend(results, 1000.0, memory_mb=100.0)  # type: ignore[misc]
    assert best.options == {"max_num_seqs": 8} and not meets  # nothing fits the memory: the lowest TTFT p99
    assert recommend([_result(8, 1, None)], 1000.0, None) is None


def test_only_causal_lm_adapters_get_the_generative_sweep(tmp_path: Path) -> None:
    for task_type, expected in (("CAUSAL_LM", True), ("FEATURE_EXTRACTION", False), (None, False)):
        (tmp_path / "adapter_config.json").write_text(json.dumps({"task_type": task_type}))
        assert is_generative(TuneSource(tmp_path, "base", "base", None, "x")) is expected
