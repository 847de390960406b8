"""bench/train.py --quick: LoRA and full fine-tuning on a small slice of the statutes."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_train_quick_writes_results(run_quick) -> None:  # type: ignore[no-untyped-def]
    data = run_quick("train", timeout=180)
    for arm in ("lora", "full"):
        result = data["arms"][arm]
        assert "error" not in result, result
        assert 0.0 <= result["test_ndcg@10"] <= 1.0
        assert result["checkpoint_bytes"] > 0
    assert data["arms"]["lora"]["trainable_params"] < data["arms"]["full"]["trainable_params"]


def test_train_generation_quick_writes_results(run_quick) -> None:  # type: ignore[no-untyped-def]
    data = run_quick("train", "--kind", "generation", timeout=900)
    lora, full = data["arms"]["lora"], data["arms"]["full"]
    assert "error" not in lora and "error" not in full, data["arms"]
    assert lora["metrics"]["train_steps"] == full["metrics"]["train_steps"]  # the same budget in steps
    assert lora["metrics"]["trainable_params"] < full["metrics"]["trainable_params"]
    assert lora["metrics"]["adapter_size_mb"] < full["metrics"]["checkpoint_size_mb"]
    assert 0 <= lora["metrics"]["test_chrf"] <= 100 and "base_test_chrf" in lora["baselines"]
    assert set(data["ratios"]) >= {"full/lora training tokens per second", "full/lora checkpoint size"}
