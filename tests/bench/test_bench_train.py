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
