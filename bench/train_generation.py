"""The generative kind of `bench/train.py`: a LoRA against full fine-tuning of SmolLM2-135M-Instruct, same budget.

Both arms use the generation task kind's dataset (statute headings, `configs/german-legal-headings.yaml`),
trl's SFTTrainer with the loss on the assistant turn only, the same schedule, seed and batch size,
and the same number of optimizer steps (the LoRA's: one epoch of the config). The full arm trains
every weight at a learning rate suited to it. Each arm runs in its own process so its peak memory
is its own; the base model and the lead baseline are scored once, in the LoRA's process.

    python -m lorafleet.bench.train --kind generation [--quick] [--arms lora,full]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from lorafleet.bench.common import fmt, say

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "german-legal-headings.yaml"
ARMS = ("lora", "full")
FULL_LR = 5e-5  # every one of 135 M weights moves: far below the LoRA's rate
QUICK = {"data": {"laws": ["kschg", "agg"], "max_train_examples": 24, "max_eval_examples": 8,
                  "input_max_tokens": 48}, "max_new_tokens": 12, "batch_size": 8}


def config(quick: bool) -> Any:
    from lorafleet.train.generation import GenerationTrainConfig

    raw = yaml.safe_load(CONFIG.read_text())["train"]
    if quick:
        raw = {**raw, **{k: v for k, v in QUICK.items() if k != "data"}, "data": {**raw["data"], **QUICK["data"]}}
    raw["device"] = "cpu" if quick else raw.get("device", "auto")
    return GenerationTrainConfig.model_validate(raw)


def run_arm(arm: str, quick: bool, work: Path, threads: int) -> dict[str, Any]:
    """In a child process: build the dataset, train one arm, report its figures."""
    import torch

    from lorafleet.train.generation import train_full, train_generation
    from lorafleet.train.generation_run import build_generation_dataset, generation_baselines

    torch.set_num_threads(threads)
    cfg = config(quick)
    dataset = build_generation_dataset(cfg)
    out: dict[str, Any] = {"arm": arm, "dataset": dataset.summary()}
    if arm == "lora":
        t0 = time.perf_counter()
        out["baselines"] = generation_baselines(cfg, dataset).metrics
        out["baselines_s"] = round(time.perf_counter() - t0, 1)
        result = train_generation(cfg, dataset, work / "lora", evaluate_test=True)  # compared with the full arm on test
    else:
        steps = int(json.loads((work / "lora.json").read_text())["metrics"]["train_steps"])
        result = train_full(cfg, dataset, work / "full", learning_rate=FULL_LR, max_steps=steps)
    out["metrics"] = {k: v for k, v in result.metrics.items() if isinstance(v, int | float)}
    out["cost"] = result.cost
    return out


def run(arms: list[str], quick: bool, threads: int, work: Path, timeout_s: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for arm in arms:
        say(f"{arm}…")
        out_file = work / f"{arm}.json"
        argv = [sys.executable, "-m", "lorafleet.bench.train", "--kind", "generation", "--arm", arm, "--child-out",
                str(out_file), "--work", str(work), "--threads", str(threads), *(["--quick"] if quick else [])]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout_s, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        except subprocess.TimeoutExpired:
            results[arm] = {"arm": arm, "error": f"did not finish within {timeout_s:.0f}s"}
            continue
        if proc.returncode != 0 or not out_file.exists():
            results[arm] = {"arm": arm, "error": f"exit {proc.returncode}: {proc.stdout[-1500:]}"}
            continue
        results[arm] = json.loads(out_file.read_text())
        results[arm]["process_wall_s"] = round(time.perf_counter() - t0, 1)
    return results


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    lo, fu = results.get("lora", {}), results.get("full", {})
    if "metrics" not in lo or "metrics" not in fu:
        return {}
    lm, fm = lo["metrics"], fu["metrics"]
    base = lo.get("baselines", {})
    return {
        "full/lora training tokens per second": round(fm["train_tokens_per_s"] / lm["train_tokens_per_s"], 2),
        "full/lora peak RSS": round(fu["cost"]["peak_rss_mb"] / lo["cost"]["peak_rss_mb"], 2),
        "full/lora checkpoint size": round(fm["checkpoint_size_mb"] / lm["adapter_size_mb"], 1),
        "lora − full test chrF": round(lm["test_chrf"] - fm["test_chrf"], 2),
        "lora / base test chrF": round(lm["test_chrf"] / base["base_test_chrf"], 3) if base.get("base_test_chrf")
        else None,
    }


def print_table(results: dict[str, Any]) -> None:
    print(f"\n{'arm':<6} {'trainable':>12} {'tokens/s':>9} {'train s':>8} {'peak RSS MB':>12} {'checkpoint MB':>14} "
          f"{'test chrF':>10} {'test ROUGE-L':>13}")
    for name, a in results.items():
        if "error" in a:
            print(f"{name:<6} failed: {a['error'][:300]}")
            continue
        m = a["metrics"]
        size = m.get("adapter_size_mb", m.get("checkpoint_size_mb"))
        print(f"{name:<6} {int(m.get('trainable_params', 0)):>12,} {fmt(m.get('train_tokens_per_s')):>9} "
              f"{fmt(m.get('train_s')):>8} {a['cost']['peak_rss_mb']:>12.0f} {fmt(size):>14} "
              f"{m['test_chrf']:>10.2f} {m['test_rouge_l']:>13.4f}")
    base = results.get("lora", {}).get("baselines", {})
    if base:
        print(f"base   test chrF {base.get('base_test_chrf', float('nan')):.2f}, lead baseline "
              f"{base.get('lead_test_chrf', float('nan')):.2f}")
