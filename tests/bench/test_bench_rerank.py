"""bench/rerank.py at a tiny size: speed, mixed adapters and quality each finish and report their ratio and target.

The tiny BERT stands in for the cross-encoder (speed and mixed adapters); quality runs the rerank kind on a small
bring-your-own pairs table. Figures are not judged here (a shared machine is too noisy); docs/benchmarks.md has the
full run.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration


def _quality_config(tmp_path: Path, model: Path) -> Path:
    words = [a + b for a in ["ka", "lo", "mi", "ru", "sen", "tav"] for b in ["ga", "te", "bo", "ni", "su"]]
    pairs = tmp_path / "pairs.csv"
    with pairs.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["query", "positive"])
        for i in range(20):
            own = [words[(i + j) % len(words)] for j in range(3)]
            writer.writerow([f"{own[0]} {own[1]}", " ".join(own * 3)])
    path = tmp_path / "rerank.yaml"
    path.write_text(yaml.safe_dump({"task": "rerank", "train": {
        "base_model": str(model),
        "data": {"layout": "pairs", "pairs": str(pairs), "num_negatives": 1, "dev_fraction": 0.2,
                 "test_fraction": 0.2},
        "first_stage": {"kind": "bm25", "embedder": str(model), "depth": 5},
        "lora": {"r": 2, "alpha": 4, "target_modules": ["query", "value"]},
        "epochs": 1, "batch_size": 4, "max_seq_length": 32, "max_pair_length": 48, "device": "cpu"}}))
    return path


def test_rerank_quick_tiny(run_quick, tiny_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = run_quick("rerank", "--model", str(tiny_model_dir), "--docs", "10", "--adapters", "3",
                     "--mixed-concurrency", "4", "--adapter-cache", str(tmp_path / "adapters"),
                     "--config", str(_quality_config(tmp_path, tiny_model_dir)), timeout=420)
    for part in ("speed", "mixed", "quality"):
        assert "error" not in data[part], (part, data[part])
        assert data[part]["ratio"] > 0 and data["summary"][part]["target"] == data[part]["target"]
    speed = data["speed"]
    assert speed["served"]["errors"] == 0 and speed["served"]["pairs_per_s"] > 0
    assert speed["ceiling_pairs_per_s"] == max(r["best_pairs_per_s"] for r in speed["raw"])
    mixed = data["mixed"]
    assert set(mixed["modes"]) == {"mixed", "one_adapter_per_batch"}
    assert all(m["errors"] == 0 and m["pairs_per_s"] > 0 for m in mixed["modes"].values())
    assert mixed["modes"]["mixed"]["profile"]["mixed_adapter_batches"] is True
    quality = data["quality"]
    assert {"bm25", "dense", "hybrid"} == set(quality["first_stages_test_ndcg@10"])
    assert quality["best_first_stage"] in quality["first_stages_test_ndcg@10"] and quality["train_wall_s"] > 0
