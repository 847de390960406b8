"""LoRA against full fine-tuning on the same data and the same time budget (issue 6 §3).

Both arms use lorafleet.train's dataset (`build_dataset`, German statutes) and evaluation
(`evaluate_model`, test nDCG@10), and the same trainer settings as `train_adapter`
(sentence-transformers trainer, MNRL loss with in-batch negatives, no-duplicates batches, same
seed, batch size, epochs and warm-up). The only differences: the LoRA arm adds the adapter
exactly as `train_adapter` does (`_add_lora`) and saves it in peft format; the full arm trains
every weight (at a learning rate suited to full fine-tuning) and saves the whole model.
`train_adapter` itself has no switch to train without the adapter, so the loop lives here.
Hard negatives are off so that both arms see identical pairs.

Each arm runs in its own process, so its peak memory (ru_maxrss) is its own. Training stops at
the configured epochs or when the time budget is spent, whichever comes first.

    python -m lorafleet.bench.train [--quick] [--epochs 2] [--budget-s 240]
    python -m lorafleet.bench.train --kind generation [--quick]     (bench/train_generation.py)
    python -m lorafleet.bench.train [--kind generation] --precision fp32,bf16 [--set key=value]
                                                                     (bench/train_precision.py)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lorafleet.bench.common import (
    RESULTS_DIR,
    finish,
    fmt,
    loadavg,
    machine_info,
    parser,
    run_head,
    say,
    stamp,
    write_json,
)
from lorafleet.bench.processes import exit_on_sigterm

ARMS = ("base", "lora", "full")
FULL_LR = 5e-5  # full fine-tuning moves every weight: an order of magnitude below LoRA's default


def train_config(quick: bool, epochs: int) -> Any:
    from lorafleet.train import TrainConfig

    if quick:
        data = {"laws": ["kschg"], "hard_negatives": False, "max_train_queries": 16, "max_eval_queries": 8,
                "max_chunks_per_section": 1}
        return TrainConfig(data=data, epochs=epochs, batch_size=8, max_seq_length=64, device="cpu",
                           eval_batch_size=32)
    # The labour-law statutes (as bench/research.py): 120 training, 38 dev and 42 test queries.
    laws = ["kschg", "milog", "tzbfg", "prodhaftg", "agg", "arbzg"]
    return TrainConfig(data={"laws": laws, "hard_negatives": False}, epochs=epochs, batch_size=16,
                       max_seq_length=128, device="cpu", eval_batch_size=32)


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_arm(arm: str, quick: bool, epochs: int, budget_s: float, out_dir: Path, threads: int) -> dict[str, Any]:
    """One arm in this process: train (unless base), evaluate test, save, measure."""
    import torch

    torch.set_num_threads(threads)
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers
    from transformers import PrinterCallback, TrainerCallback, set_seed

    from lorafleet.train import build_dataset, evaluate_model
    from lorafleet.train.kinds.retrieval.trainer import _add_lora, load_base_model, save_adapter

    cfg = train_config(quick, epochs)
    t_load = time.perf_counter()
    dataset = build_dataset(cfg)
    set_seed(cfg.seed)
    model = load_base_model(cfg.base_model, "cpu", cfg.max_seq_length)
    out: dict[str, Any] = {"arm": arm, "dataset": dataset.summary(), "load_s": round(time.perf_counter() - t_load, 1),
                           "torch_threads": torch.get_num_threads()}
    total = sum(p.numel() for p in model.parameters())
    if arm == "lora":
        _add_lora(model, cfg)
    out["peak_rss_before_training_mb"] = peak_rss_mb()
    if arm != "base":
        from datasets import Dataset

        pairs = dataset.train_pairs()
        train_data = Dataset.from_dict({"anchor": [q for q, _ in pairs], "positive": [p for _, p in pairs]})
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        lr = cfg.learning_rate if arm == "lora" else FULL_LR
        epoch_ends: list[float] = []
        started = [0.0]
        stopped_by_budget = [False]

        class Clock(TrainerCallback):  # type: ignore[misc]
            def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                started[0] = time.perf_counter()

            def on_epoch_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                epoch_ends.append(time.perf_counter())

            def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                if time.perf_counter() - started[0] > budget_s:
                    stopped_by_budget[0] = True
                    control.should_training_stop = True

        scratch = Path(tempfile.mkdtemp(prefix="bench-train-"))
        args = SentenceTransformerTrainingArguments(
            output_dir=str(scratch), num_train_epochs=cfg.epochs, per_device_train_batch_size=cfg.batch_size,
            learning_rate=lr, warmup_steps=cfg.warmup_ratio, weight_decay=cfg.weight_decay,
            batch_sampler=BatchSamplers.NO_DUPLICATES, seed=cfg.seed, data_seed=cfg.seed, save_strategy="no",
            eval_strategy="no", logging_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train_data,
                                             loss=MultipleNegativesRankingLoss(model, scale=cfg.scale),
                                             callbacks=[Clock()])
        trainer.remove_callback(PrinterCallback)
        say(f"  {arm}: training {len(pairs)} pairs, {cfg.epochs} epoch(s) or {budget_s:.0f}s, "
            f"{trainable:,} of {total:,} parameters trainable, lr {lr:g}")
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
        steps_per_epoch = max(1, math.ceil(len(train_data) / cfg.batch_size))
        done_epochs = trainer.state.global_step / steps_per_epoch
        bounds = [started[0], *epoch_ends]
        per_epoch = [round(b - a, 2) for a, b in itertools.pairwise(bounds)]
        out.update({"trainable_params": trainable, "total_params": total, "learning_rate": lr,
                    "train_s": round(train_s, 2),
                    "epochs_done": round(done_epochs, 2), "steps": trainer.state.global_step,
                    "seconds_per_epoch": round(train_s / done_epochs, 2) if done_epochs else None,
                    "epoch_seconds": per_epoch, "stopped_by_budget": stopped_by_budget[0]})
        out["peak_rss_training_mb"] = peak_rss_mb()
        model.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        metrics = evaluate_model(model, dataset, "test", batch_size=cfg.eval_batch_size)
    out["eval_s"] = round(time.perf_counter() - t0, 1)
    out["test_ndcg@10"] = round(metrics["test_ndcg@10"], 4)
    out["test_metrics"] = {k: round(v, 4) for k, v in metrics.items()}
    if arm != "base":
        ckpt = out_dir / f"{arm}-checkpoint"
        if arm == "lora":
            save_adapter(model, ckpt, cfg.base_model)
        else:
            model.save(str(ckpt))
        out["checkpoint_bytes"] = dir_size(ckpt)
        out["checkpoint_files"] = sorted(p.name for p in ckpt.rglob("*") if p.is_file())
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def run_child(arm: str, quick: bool, epochs: int, budget_s: float, work: Path, timeout_s: float,
              threads: int) -> dict[str, Any]:
    out_file = work / f"{arm}.json"
    argv = [sys.executable, "-m", "lorafleet.bench.train", "--arm", arm, "--child-out", str(out_file),
            "--epochs", str(epochs), "--budget-s", str(budget_s), "--work", str(work), "--threads", str(threads)]
    argv += ["--quick"] if quick else []
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout_s, text=True)
    except subprocess.TimeoutExpired:
        return {"arm": arm, "error": f"did not finish within {timeout_s:.0f}s"}
    if proc.returncode != 0 or not out_file.exists():
        return {"arm": arm, "error": f"exit {proc.returncode}: {proc.stdout[-1500:]}"}
    for line in proc.stdout.splitlines():
        if line.startswith("  "):
            say(line)
    res = json.loads(out_file.read_text())
    res["process_wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def print_table(result: dict[str, Any]) -> None:
    arms = result["arms"]
    print(f"\n{'arm':<6} {'trainable':>12} {'s/epoch':>8} {'epochs':>7} {'peak RSS MB':>12} {'checkpoint':>12} "
          f"{'test nDCG@10':>13}")
    for name, a in arms.items():
        if "error" in a:
            print(f"{name:<6} failed: {a['error'][:300]}")
            continue
        ck = a.get("checkpoint_bytes")
        print(f"{name:<6} {a.get('trainable_params', 0):>12,} {fmt(a.get('seconds_per_epoch')):>8} "
              f"{fmt(a.get('epochs_done'), 2):>7} {a['peak_rss_mb']:>12.0f} "
              f"{(f'{ck / 2**20:.2f} MiB' if ck else '-'):>12} {a['test_ndcg@10']:>13.4f}")
    for k, v in result.get("ratios", {}).items():
        print(f"{k}: {v}")


def main(argv: list[str] | None = None) -> int:
    p = parser("train", __doc__)
    p.add_argument("--quick", action="store_true", help="Two small laws, 1 epoch, short sequences (under a minute).")
    p.add_argument("--epochs", type=int, default=None, help="Epochs per arm (default 2; quick 1).")
    p.add_argument("--budget-s", type=float, default=None, help="Training time budget per arm (default 150; quick 30).")
    p.add_argument("--kind", choices=("retrieval", "generation"), default="retrieval",
                   help="Task kind: retrieval (MiniLM, nDCG@10) or generation (SmolLM2, chrF).")
    p.add_argument("--arms", default=None,
                   help="Comma-separated subset of base,lora,full (default all; quick lora,full).")
    p.add_argument("--threads", type=int, default=None, help="torch threads per arm (default: the number of CPUs).")
    p.add_argument("--out", type=Path, default=None, help="Result JSON (default bench/results/train.json, "
                   "train-generation.json for --kind generation).")
    p.add_argument("--precision", default=None,
                   help="Compare training precisions instead of arms, e.g. fp32,bf16: the config's own training "
                   "(train_adapter / train_generation) at each, side by side (bench/train_precision.py). An arm may "
                   "pin the dropout masks: fp32:torch,fp32,bf16 adds fp32 with torch's own masks.")
    p.add_argument("--config", type=Path, default=None, help="With --precision: the config whose train: section "
                   "runs (default configs/german-legal.yaml, or german-legal-headings.yaml for --kind generation).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="With --precision: override a train: key (repeatable), e.g. data.max_train_queries=160.")
    p.add_argument("--rounds", type=int, default=1, help="With --precision: rounds, alternating the order.")
    p.add_argument("--precision-child", help=argparse.SUPPRESS)
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    exit_on_sigterm()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    epochs = args.epochs or (1 if args.quick else 2)
    threads = args.threads or os.cpu_count() or 1
    budget_s = args.budget_s or (30.0 if args.quick else 150.0)
    if args.precision or args.precision_child:
        return _precision(args, threads)
    if args.kind == "generation":
        return _generation(args, threads)
    args.out = args.out or RESULTS_DIR / "train.json"
    if args.arm:  # child: one arm, result to --child-out
        import logging

        logging.basicConfig(level=logging.WARNING)
        res = run_arm(args.arm, args.quick, epochs, budget_s, args.work or Path(tempfile.mkdtemp()), threads)
        args.child_out.write_text(json.dumps(res))
        return 0
    arms = args.arms.split(",") if args.arms else (["lora", "full"] if args.quick else list(ARMS))
    bad = [a for a in arms if a not in ARMS]
    if bad:
        print(f"error: unknown arm(s) {bad}; choose from {ARMS}", file=sys.stderr)
        return 2
    info = machine_info()
    say(f"bench/train: arms {arms}; {epochs} epoch(s) or {budget_s:.0f}s of training per arm; "
        f"load average {info['loadavg_start']}")
    t0 = time.monotonic()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-train-") as tmp:
        for arm in arms:
            say(f"{arm}…")
            results[arm] = run_child(arm, args.quick, epochs, budget_s, Path(tmp), timeout_s=budget_s + 420,
                                     threads=threads)
    cfg = train_config(args.quick, epochs)
    ratios: dict[str, Any] = {}
    lo, fu = results.get("lora", {}), results.get("full", {})
    if "test_ndcg@10" in lo and "test_ndcg@10" in fu:
        ratios = {
            "full/lora seconds per epoch": round(fu["seconds_per_epoch"] / lo["seconds_per_epoch"], 2),
            "full/lora peak RSS while training": round(fu["peak_rss_training_mb"] / lo["peak_rss_training_mb"], 2),
            "full/lora RSS growth while training": round(
                (fu["peak_rss_training_mb"] - fu["peak_rss_before_training_mb"])
                / max(lo["peak_rss_training_mb"] - lo["peak_rss_before_training_mb"], 1.0), 2),
            "full/lora checkpoint size": round(fu["checkpoint_bytes"] / lo["checkpoint_bytes"], 1),
            "lora − full test nDCG@10": round(lo["test_ndcg@10"] - fu["test_ndcg@10"], 4),
        }
        if "base" in results and "test_ndcg@10" in results["base"]:
            ratios["lora − base test nDCG@10"] = round(lo["test_ndcg@10"] - results["base"]["test_ndcg@10"], 4)
            ratios["full − base test nDCG@10"] = round(fu["test_ndcg@10"] - results["base"]["test_ndcg@10"], 4)
    result = {
        **run_head("train", args.quick, info),
        "setup": {"torch_threads": threads, "base_model": cfg.base_model, "laws": cfg.data.laws,
                  "hard_negatives": False, "epochs": epochs,
                  "time_budget_s_per_arm": budget_s, "batch_size": cfg.batch_size,
                  "max_seq_length": cfg.max_seq_length, "loss": "MNRL (in-batch negatives)",
                  "lora": cfg.lora.model_dump(), "lora_learning_rate": cfg.learning_rate,
                  "full_learning_rate": FULL_LR, "seed": cfg.seed},
        "arms": results, "ratios": ratios, "wall_s": round(time.monotonic() - t0, 1),
    }
    finish(args.out, result, print_table)
    return 0 if all("error" not in r for r in results.values()) else 1


def _precision(args: argparse.Namespace, threads: int) -> int:
    from lorafleet.bench import train_precision as tp

    config = args.config or tp.CONFIGS[args.kind]
    if args.precision_child:  # child: one run, result to --child-out
        import logging

        logging.basicConfig(level=logging.WARNING)
        res = tp.run_one(args.kind, args.precision_child, config, args.overrides, args.quick,
                         args.work or Path(tempfile.mkdtemp()), threads)
        args.child_out.write_text(json.dumps(res))
        return 0
    precisions = args.precision.split(",")
    try:
        for arm in precisions:
            tp.parse_arm(arm)
    except ValueError as exc:
        print(f"error: --precision: {exc}", file=sys.stderr)
        return 2
    if len(set(precisions)) != len(precisions):
        print("error: --precision names an arm twice", file=sys.stderr)
        return 2
    info = machine_info()
    say(f"bench/train --precision {args.precision}: {args.kind}, {config.name} {' '.join(args.overrides)}; "
        f"{args.rounds} round(s), {threads} torch thread(s); load average {info['loadavg_start']}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-precision-") as tmp:
        res = tp.run(args.kind, precisions, config, args.overrides, args.quick, args.rounds, threads, Path(tmp),
                     timeout_s=900 if args.quick else 5400)
    result = {
        "benchmark": "train", "kind": args.kind, "axis": "precision", "when": stamp(), "quick": args.quick,
        "machine": {**info, "loadavg_end": loadavg()},
        "setup": {"torch_threads": threads, "config": str(config.relative_to(tp.REPO) if config.is_relative_to(tp.REPO)
                                                          else config),
                  "overrides": [*(tp.QUICK[args.kind] if args.quick else []), *args.overrides],
                  "precisions": precisions, "rounds": args.rounds},
        **res, "wall_s": round(time.monotonic() - t0, 1),
    }
    name = f"train-precision{'-generation' if args.kind == 'generation' else ''}{'-quick' if args.quick else ''}.json"
    out = args.out or RESULTS_DIR / name
    write_json(out, result)
    tp.print_table(args.kind, result)
    print(f"\nwrote {out} ({result['wall_s']:.0f}s)")
    return 0 if all("error" not in r for r in res["runs"]) else 1


def _generation(args: argparse.Namespace, threads: int) -> int:
    from lorafleet.bench import train_generation as gen

    if args.arm:  # child: one arm, result to --child-out
        import logging

        logging.basicConfig(level=logging.WARNING)
        args.child_out.write_text(json.dumps(gen.run_arm(args.arm, args.quick, args.work, threads)))
        return 0
    arms = args.arms.split(",") if args.arms else list(gen.ARMS)
    if [a for a in arms if a not in gen.ARMS] or (arms and "full" in arms and "lora" not in arms):
        print(f"error: --kind generation takes arms from {gen.ARMS} (full needs lora: it takes the LoRA's step "
              "count)", file=sys.stderr)
        return 2
    info = machine_info()
    say(f"bench/train --kind generation: arms {arms}; {threads} torch thread(s); load average {info['loadavg_start']}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-gen-") as tmp:
        results = gen.run(arms, args.quick, threads, Path(tmp), timeout_s=900 if args.quick else 5400)
    cfg = gen.config(args.quick)
    result = {
        "benchmark": "train", "kind": "generation", "when": stamp(), "quick": args.quick,
        "machine": {**info, "loadavg_end": loadavg()},
        "setup": {"torch_threads": threads, "base_model": cfg.base_model, "laws": cfg.data.laws,
                  "train_examples": cfg.data.max_train_examples, "epochs": cfg.epochs, "batch_size": cfg.batch_size,
                  "lora": cfg.lora.model_dump(), "lora_learning_rate": cfg.learning_rate,
                  "full_learning_rate": gen.FULL_LR, "steps": "the LoRA's (one run of the config)", "seed": cfg.seed},
        "arms": results, "ratios": gen.ratios(results), "wall_s": round(time.monotonic() - t0, 1),
    }
    out = args.out or RESULTS_DIR / ("train-generation-quick.json" if args.quick else "train-generation.json")
    write_json(out, result)
    gen.print_table(results)
    for k, v in result["ratios"].items():
        print(f"{k}: {v}")
    print(f"\nwrote {out} ({result['wall_s']:.0f}s)")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
