"""bench/adapters.py on a tiny BERT: mixed batches, one adapter per batch and the scale phase finish and report."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_adapters_quick_tiny(run_quick, tiny_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = run_quick("adapters", "--model", str(tiny_model_dir), "--adapter-cache", str(tmp_path / "adapters"),
                     "--ns", "2", "--modes", "before,today,mixed", "--capacity", "20", "--point-s", "0.5",
                     "--scale-adapters", "6", "--scale-hot", "2", "--scale-s", "2", "--scale-cold", "2",
                     "--slo-ms", "2000", timeout=300)
    cells = data["cells"]
    assert set(cells) == {f"{m}/w1/n2/{t}" for m in ("before", "today", "mixed") for t in ("uniform", "zipf")}
    for key, cell in cells.items():
        assert "error" not in cell, (key, cell)
        assert cell["points"] and cell["saturation_rps"] > 0
        assert any(p["overload"] for p in cell["points"])
        assert all(p["errors"] == 0 for p in cell["points"]), key
    assert data["setups"]["mixed/w1"]["profile"]["mixed_adapter_batches"] is True
    assert data["setups"]["today/w1"]["profile"]["mixed_adapter_batches"] is False
    assert data["setups"]["mixed/w1"]["warm"][0]["not_hot"] == 0
    scale = data["scale"]
    assert "error" not in scale, scale
    assert scale["cold_first_request"]["n"] == 2 and scale["warm_second_request"]["n"] == 2
    assert scale["churn"]["errors"] == 0 and scale["churn"]["adapters_touched"] >= 2
    assert scale["rss_mib"]["peak"] > 0
    assert data["setup"]["torch_threads_per_worker"] == 1
    assert {"mixed/today n2 uniform w1", "mixed/before n2 uniform w1"} <= set(data["summary"]["ratios"])
    assert set(data["summary"]["targets"]) == {"mixed_ge_2x_today_saturation_at_64",
                                               "mixed_ge_0.85x_ceiling_saturation_at_64",
                                               "p99_512_zipf_warm_within_1.5x_single"}
