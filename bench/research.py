"""Pruning pays: the same research budget with and without the pruner.

Both arms run the same study (same search space, same sampler seed, same trial cap) on the real
train stage, each in a fresh LORAFLEET_HOME. Reported per arm: trials finished (complete /
pruned), best dev nDCG@10, and the compute the trials spent (wall and CPU seconds, summed over
trials; baseline and summary are the same in both arms and left out). Target: with pruning, a
winner at least as good for at most 60 % of the compute.

    python -m lorafleet.bench.research [--quick] [--trials N] [--out bench/results/research.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


def train_section(quick: bool) -> dict[str, Any]:
    # Labour-law statutes: quick ~73 training / 27 dev queries, full ~120 / 38 (all the queries they have).
    laws = ["kschg", "milog", "tzbfg", "prodhaftg"] + ([] if quick else ["agg", "arbzg"])
    data: dict[str, Any] = {"laws": laws, "hard_negatives": False}
    return {"base_model": "all-MiniLM-L6-v2", "data": data, "lora": {"r": 8, "alpha": 16, "dropout": 0.05,
            "target_modules": ["query", "value"]}, "batch_size": 8 if quick else 16,
            "max_seq_length": 96 if quick else 128, "device": "cpu", "eval_batch_size": 64, "epochs": 2}


def research_section(pruner: dict[str, Any], trials: int, quick: bool) -> dict[str, Any]:
    return {
        "study": "bench",
        "n_trials": trials,
        "budget_minutes": 120,
        "trial_timeout_minutes": 30,
        "sampler": {"kind": "tpe", "seed": 0, "n_startup_trials": 3},
        "pruner": pruner,
        "reseed": False,  # the bench compares the search itself
        "min_margin": 0.0,
        "space": {
            "learning_rate": {"type": "float", "low": 1e-5, "high": 1e-2, "log": True},
            "epochs": {"type": "int", "low": 1, "high": 3 if quick else 4},
            "lora.r": {"type": "categorical", "choices": [4, 8, 16]},
        },
    }


def run_arm(name: str, pruner: dict[str, Any], trials: int, quick: bool) -> dict[str, Any]:
    import optuna

    from lorafleet.research.config import from_raw
    from lorafleet.research.runner import run_research

    with tempfile.TemporaryDirectory(prefix=f"lorafleet-bench-{name}-") as home:
        os.environ["LORAFLEET_HOME"] = home
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        loaded = from_raw(train_section(quick), research_section(pruner, trials, quick), f"bench:{name}")
        t0, c0 = time.monotonic(), time.process_time()
        result = run_research(loaded, progress_live=False)
        total_wall, total_cpu = time.monotonic() - t0, time.process_time() - c0
        study = optuna.load_study(study_name="bench", storage=f"sqlite:///{home}/optuna/optuna.db")
        trials_ = study.get_trials()
        rows = [{"number": t.number, "state": t.state.name.lower(), "value": t.value, "params": t.params,
                 "epochs_run": len(t.intermediate_values), "wall_s": t.user_attrs.get("wall_s"),
                 "cpu_s": t.user_attrs.get("cpu_s")} for t in trials_]
    complete = [r for r in rows if r["state"] == "complete"]
    return {
        "arm": name, "pruner": pruner,
        "trials_complete": len(complete),
        "trials_pruned": sum(r["state"] == "pruned" for r in rows),
        "trials_failed": sum(r["state"] == "fail" for r in rows),
        "best_dev_ndcg@10": max((r["value"] for r in complete), default=None),
        "best_trial": result.winner_trial,
        "epochs_trained": sum(r["epochs_run"] for r in rows),
        "trial_wall_s": round(sum(r["wall_s"] or 0 for r in rows), 1),
        "trial_cpu_s": round(sum(r["cpu_s"] or 0 for r in rows), 1),
        "run_wall_s": round(total_wall, 1), "run_cpu_s": round(total_cpu, 1),
        "base_dev_ndcg@10": result.baseline.get("base_dev_ndcg@10"),
        "best_vs_budget": best_vs_budget(rows),
        "trials": rows,
    }


def best_vs_budget(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Best complete dev objective after each trial, against the trial compute spent so far (minutes)."""
    spent, best, out = 0.0, None, []
    for r in sorted(rows, key=lambda r: r["number"]):
        spent += r["wall_s"] or 0.0
        if r["state"] == "complete" and r["value"] is not None:
            best = r["value"] if best is None else max(best, r["value"])
        out.append({"after_trial": r["number"], "minutes": round(spent / 60.0, 2), "best": best})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="One small law, fewer trials (a few minutes on CPU).")
    parser.add_argument("--trials", type=int, default=None, help="Trial cap of both arms (default 10, quick 5).")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "research.json")
    args = parser.parse_args()
    trials = args.trials or (5 if args.quick else 10)
    load0 = os.getloadavg()
    arms = [
        run_arm("no-pruner", {"kind": "none"}, trials, args.quick),
        run_arm("median-pruner", {"kind": "median", "n_startup_trials": 2, "n_warmup_steps": 0}, trials, args.quick),
    ]
    off, on = arms
    ratio = on["trial_wall_s"] / off["trial_wall_s"] if off["trial_wall_s"] else None
    cpu_ratio = on["trial_cpu_s"] / off["trial_cpu_s"] if off["trial_cpu_s"] else None
    # Epochs trained: a compute measure that the machine's load cannot move (every epoch costs about the same).
    epoch_ratio = on["epochs_trained"] / off["epochs_trained"] if off["epochs_trained"] else None
    as_good = (on["best_dev_ndcg@10"] or 0) >= (off["best_dev_ndcg@10"] or 0) - 1e-9
    summary = {
        "benchmark": "research", "when": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick,
        "trial_cap": trials,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_at_start": load0,
                    "loadavg_at_end": os.getloadavg()},
        "arms": arms,
        "pruned_vs_unpruned_wall": ratio, "pruned_vs_unpruned_cpu": cpu_ratio,
        "pruned_vs_unpruned_epochs": epoch_ratio,
        "winner_at_least_as_good": as_good,
        "target_met": bool(as_good and ratio is not None and ratio <= 0.6),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2, default=str))
    print(f"\nresearch bench ({'quick' if args.quick else 'full'}), trial cap {trials}, same seeds; "
          f"load avg at start {load0[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'arm':<15} {'complete':>8} {'pruned':>7} {'epochs':>7} {'best dev nDCG@10':>17} "
          f"{'trial wall s':>13} {'trial cpu s':>12}")
    for a in arms:
        best = "–" if a["best_dev_ndcg@10"] is None else f"{a['best_dev_ndcg@10']:.4f}"
        print(f"{a['arm']:<15} {a['trials_complete']:>8} {a['trials_pruned']:>7} {a['epochs_trained']:>7} "
              f"{best:>17} {a['trial_wall_s']:>13.1f} {a['trial_cpu_s']:>12.1f}")
    if ratio is not None:
        print(f"pruned/unpruned compute: wall {ratio:.2f}, cpu {cpu_ratio:.2f}, epochs {epoch_ratio:.2f}; "
              f"winner at least as good: {as_good}; "
              f"target (<= 0.60 and as good) met: {summary['target_met']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
