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
    from lorafleet.train.kinds.generation.trainer import GenerationTrainConfig

    raw = yaml.safe_load(CONFIG.read_text())["train"]
    if quick:
        raw = {**raw, **{k: v for k, v in QUICK.items() if k != "data"}, "data": {**raw["data"], **QUICK["data"]}}
    raw["device"] = "cpu" if quick else raw.get("device", "auto")
    return GenerationTrainConfig.model_validate(raw)


def run_arm(arm: str, quick: bool, work: Path, threads: int) -> dict[str, Any]:
    """In a child process: build the dataset, train one arm, report its figures."""
    import torch

    from lorafleet.train.kinds.generation.run import build_generation_dataset, generation_baselines
    from lorafleet.train.kinds.generation.trainer import train_full, train_generation

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


# ---------------------------------------------------------------- recipe ablation
# `python -m lorafleet.bench.train_generation --recipe [--arms a,b] [--train N] [--eval N]`: each arm is the
# config with a few keys changed, trained and scored on a reduced budget (fewer sections) so that the knobs
# can be ranked on a shared 2-core CPU; the baselines are scored once per dataset (base, input length).
RECIPE_ARMS: dict[str, dict[str, Any]] = {
    "today": {"learning_rate": 2e-3, "epochs": 1},
    "ep4": {"learning_rate": 2e-3, "epochs": 4},
    "ep3": {"learning_rate": 2e-3, "epochs": 3},
    "ep3-lr5e-4": {"learning_rate": 5e-4, "epochs": 3},
    "ep3-in32": {"learning_rate": 2e-3, "epochs": 3, "data.input_max_tokens": 32},
    "ep4-lr5e-4": {"learning_rate": 5e-4, "epochs": 4},
    "ep4-in48": {"learning_rate": 2e-3, "epochs": 4, "data.input_max_tokens": 48},
    "ep4-r64": {"learning_rate": 2e-3, "epochs": 4, "lora.r": 64, "lora.alpha": 128},
    "ep4-cosine": {"learning_rate": 2e-3, "epochs": 4, "lr_scheduler": "cosine"},
    "ep4-packing": {"learning_rate": 2e-3, "epochs": 4, "packing": True},
    "full-ep4": {"full": True, "learning_rate": 5e-5, "epochs": 4},
    "gemma-ep4": {"base_model": "gemma-3-270m", "learning_rate": 2e-3, "epochs": 4},
}


def recipe_config(overrides: dict[str, Any], train: int, evals: int, extra: list[str] | None = None) -> Any:
    from lorafleet.core.config import apply_overrides
    from lorafleet.train.kinds.generation.trainer import GenerationTrainConfig

    raw = yaml.safe_load(CONFIG.read_text())["train"]
    pairs = [f"{k}={json.dumps(v)}" for k, v in overrides.items() if k != "full"]
    raw = apply_overrides(raw, [*pairs, f"data.max_train_examples={train}", f"data.max_eval_examples={evals}",
                                "device=cpu", *(extra or [])])
    return GenerationTrainConfig.model_validate(raw)


def lead_only(dataset: Any) -> Any:
    """The lead baseline alone (no generation): the ablation ranks knobs, the baselines are the full run's."""
    from lorafleet.core.metrics import prefixed
    from lorafleet.train.kinds.generation.evaluate import fit_lead_length, lead_baseline, text_metrics
    from lorafleet.train.kinds.generation.run import Baselines

    train = dataset.examples["train"]
    n = fit_lead_length([ex.input for ex in train], [ex.heading for ex in train])
    metrics: dict[str, float] = {}
    for split in ("dev", "test"):
        answers = lead_baseline([ex.input for ex in dataset.examples[split]], n)
        metrics.update(prefixed(text_metrics(answers, dataset.references(split), split), "lead"))
    return Baselines(metrics=metrics, lead_words=n)


def run_recipe(arms: list[str], train: int, evals: int, out: Path, kshot_other: bool,
               lead_baseline_only: bool = False, extra: list[str] | None = None) -> dict[str, Any]:
    """Train every arm in this process (one after the other); results land in `out` after each arm."""
    import torch

    from lorafleet.train.kinds.generation.run import build_generation_dataset, generation_baselines
    from lorafleet.train.kinds.generation.trainer import train_full, train_generation

    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"arms": {}, "baselines": {}}
    results.update(threads=torch.get_num_threads(), train_examples=train, eval_examples=evals, common=extra or [])
    for arm in arms:
        spec = RECIPE_ARMS[arm]
        cfg = recipe_config(spec, train, evals, extra)
        if not kshot_other:
            cfg = cfg.model_copy(update={"baselines": cfg.baselines.model_copy(update={"other_model": None})})
        key = f"{cfg.base_model}/in{cfg.data.input_max_tokens}"
        dataset = build_generation_dataset(cfg)
        if key not in results["baselines"]:
            t0 = time.perf_counter()
            b = lead_only(dataset) if lead_baseline_only else generation_baselines(cfg, dataset)
            results["baselines"][key] = {**{k: v for k, v in b.metrics.items() if "test" in k or "dev" in k},
                                         "seconds": round(time.perf_counter() - t0, 1)}
        t0 = time.perf_counter()
        with_tmp = Path(out.parent) / f".recipe-{arm}"
        try:
            if spec.get("full"):
                r = train_full(cfg, dataset, with_tmp, learning_rate=cfg.learning_rate)
            else:
                r = train_generation(cfg, dataset, with_tmp, evaluate_test=True)
        except Exception as exc:  # one failed arm must not lose the others
            results["arms"][arm] = {"overrides": spec, "error": repr(exc)[:500]}
        else:
            m = r.metrics
            results["arms"][arm] = {
                "overrides": spec, "baselines": key, "wall_s": round(time.perf_counter() - t0, 1),
                "load1": os.getloadavg()[0],
                **{k: m[k] for k in ("dev_rouge_l", "test_rouge_l", "dev_exact_match", "test_exact_match",
                                     "test_chrf", "test_pred_words", "train_s", "train_tokens_per_s",
                                     "train_tokens_per_epoch", "train_steps", "trainable_params") if k in m},
                "epochs": [{k: round(v, 4) for k, v in e.items() if k in ("epoch", "train_loss", "dev_rouge_l",
                                                                           "dev_exact_match")} for e in r.epochs],
            }
        import shutil

        shutil.rmtree(with_tmp, ignore_errors=True)
        out.write_text(json.dumps(results, indent=2, sort_keys=True))
        say(f"{arm}: {json.dumps(results['arms'][arm])}")
    return results


def main(argv: list[str] | None = None) -> int:
    import argparse
    import logging

    p = argparse.ArgumentParser(prog="python -m lorafleet.bench.train_generation")
    p.add_argument("--recipe", action="store_true", help="Run the recipe ablation (RECIPE_ARMS).")
    p.add_argument("--arms", default=",".join(RECIPE_ARMS))
    p.add_argument("--train", type=int, default=160, help="Training sections (reduced budget).")
    p.add_argument("--eval", type=int, default=40, help="Dev and test sections, each.")
    p.add_argument("--no-other", action="store_true", help="Skip the other packaged base's k-shot baseline.")
    p.add_argument("--set", action="append", default=[], help="key=value for every arm (precision=bf16).")
    p.add_argument("--lead-only", action="store_true", help="Score the lead baseline only (no base generation).")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "train-generation-recipe.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not args.recipe:
        p.error("only --recipe is run from here; the LoRA/full comparison is `python -m lorafleet.bench.train "
                "--kind generation`")
    run_recipe(args.arms.split(","), args.train, args.eval, args.out, not args.no_other, args.lead_only, args.set)
    return 0


if __name__ == "__main__":
    sys.exit(main())
