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


def test_train_precision_quick_writes_results(run_quick) -> None:  # type: ignore[no-untyped-def]
    from lorafleet.models.precision import native_cpu_precisions, read_cpuinfo

    if "bf16" not in native_cpu_precisions(read_cpuinfo()):
        pytest.skip("this CPU has no native bf16: training at bf16 is refused here")
    data = run_quick("train", "--precision", "fp32,bf16", "--threads", "1", timeout=600)
    runs = {r["precision"]: r for r in data["runs"]}
    assert set(runs) == {"fp32", "bf16"} and all("error" not in r for r in runs.values()), data["runs"]
    assert {p: r["training_precision"] for p, r in runs.items()} == {"fp32": "fp32", "bf16": "bf16"}
    assert all(0.0 <= r["metrics"]["test_ndcg@10"] <= 1.0 and r["metrics"]["train_s"] > 0 for r in runs.values())
    assert all(r["ceiling"]["speedup"] > 0 for r in runs.values())
    assert "bf16 speed-up, training loop (wall)" in data["summary"]


def test_precision_arms_may_pin_the_dropout_masks() -> None:
    from lorafleet.bench.train_precision import parse_arm, summarise

    assert parse_arm("fp32") == ("fp32", None) and parse_arm("bf16:torch") == ("bf16", "torch")
    for bad in ("fp16", "fp32:philox"):
        with pytest.raises(ValueError, match="fp32 or bf16"):
            parse_arm(bad)

    def run(arm: str, train_s: float, ndcg: float) -> dict[str, object]:
        return {"precision": arm, "train_wall_s": train_s + 10, "ceiling": {"speedup": 1.2, "speedup_cpu": 1.3},
                "metrics": {"train_s": train_s, "train_cpu_s": 2 * train_s, "test_ndcg@10": ndcg, "dev_ndcg@10": ndcg}}

    runs = [run("fp32:torch", 150.0, 0.45), run("fp32", 120.0, 0.44), run("bf16", 100.0, 0.445)]
    summary = summarise("retrieval", runs)
    assert summary["fp32: fast dropout masks speed-up, training loop (wall)"] == 1.25
    assert summary["fp32: fast − torch masks test_ndcg@10"] == -0.01
    assert summary["bf16 speed-up, training loop (wall)"] == 1.2
    assert summary["bf16 with fast masks against fp32 with torch's (wall)"] == 1.5
