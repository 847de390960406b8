"""The precision axis of `bench/train.py`: the same training at fp32 and at bf16 (autocast, float32 weights).

Each (precision, round) trains in a process of its own through the real path of `lorafleet train`:
`train_adapter` for retrieval (hard negatives mined with the base, dev scored each epoch, test at the end),
`train_generation` for generation (dev generated each epoch, test at the end); the same config, data and
seed, only `precision` differs. Evaluation is float32 in both, so the scores judge the training alone. Rounds
alternate the order (fp32 first, then bf16 first) so that a change of load hurts both alike. The
baselines (base model, BM25, lead) do not depend on the training precision and are not run.

Beside each run, the process measures the ceiling: one forward and backward pass of the LoRA model on a
training-shaped batch, at fp32 and under bf16 autocast, alternating, median of `CEILING_REPS` — the speed-up
the training loop could reach if nothing but those passes took time.

    python -m lorafleet.bench.train --precision fp32,bf16 [--config configs/german-legal.yaml]
        [--set data.max_train_queries=160 ...] [--rounds 2] [--threads 1]
    python -m lorafleet.bench.train --kind generation --precision fp32,bf16 [--set ...]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lorafleet.bench.common import fmt, loadavg, say

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"retrieval": REPO / "configs" / "german-legal.yaml",
           "generation": REPO / "configs" / "german-legal-headings.yaml"}
CEILING_REPS = 3
# --quick: a minute-sized slice of each config (the smoke test's).
QUICK = {
    "retrieval": ["data.laws=[kschg]", "data.hard_negatives=false", "data.max_train_queries=16",
                  "data.max_eval_queries=8", "data.max_chunks_per_section=1", "epochs=1", "batch_size=8",
                  "max_seq_length=64"],
    "generation": ["data.laws=[kschg,agg]", "data.max_train_examples=16", "data.max_eval_examples=6",
                   "data.input_max_tokens=48", "max_new_tokens=8", "baselines.other_model=null"],
}
HEADLINE = {"retrieval": "test_ndcg@10", "generation": "test_rouge_l"}


def parse_arm(arm: str) -> tuple[str, str | None]:
    """`fp32`, `bf16`, or either with the dropout masks pinned (`fp32:torch`, `bf16:fast`): (precision, masks)."""
    precision, _, masks = arm.partition(":")
    if precision not in ("fp32", "bf16") or masks not in ("", "fast", "torch"):
        raise ValueError(f"{arm!r}: an arm is fp32 or bf16, optionally with :torch or :fast (the dropout masks)")
    return precision, masks or None


def load_config(kind: str, path: Path, overrides: list[str], quick: bool, arm: str) -> Any:
    from lorafleet.core.config import apply_overrides, read_yaml, validate_model

    precision, masks = parse_arm(arm)
    raw = read_yaml(path)["train"]
    raw = apply_overrides(raw, [*(QUICK[kind] if quick else []), *overrides, f"precision={precision}", "device=cpu",
                                *([f"dropout_masks={masks}"] if masks else [])])
    if kind == "generation":
        from lorafleet.train.kinds.generation.config import GenerationTrainConfig

        return validate_model(GenerationTrainConfig, raw, source=f"{path} [train]")
    from lorafleet.train.kinds.retrieval.config import TrainConfig

    return validate_model(TrainConfig, raw, source=f"{path} [train]")


# ---------------------------------------------------------------- the ceiling: raw forward + backward


def _alternate(steps: dict[str, Any]) -> dict[str, Any]:
    """Median wall and CPU seconds of each step function, measured alternately after one warm-up each, and
    fp32/bf16 of both (CPU seconds move less with other processes' load on a shared machine)."""
    wall: dict[str, list[float]] = {p: [] for p in steps}
    cpu: dict[str, list[float]] = {p: [] for p in steps}
    for fn in steps.values():
        fn()
    for _ in range(CEILING_REPS):
        for p, fn in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[p].append(time.perf_counter() - t0)
            cpu[p].append(time.process_time() - c0)
    w = {p: statistics.median(v) for p, v in wall.items()}
    c = {p: statistics.median(v) for p, v in cpu.items()}
    return {"step_s": {p: round(v, 3) for p, v in w.items()}, "step_cpu_s": {p: round(v, 3) for p, v in c.items()},
            "speedup": round(w["fp32"] / w["bf16"], 2), "speedup_cpu": round(c["fp32"] / c["bf16"], 2)}


def _step(model: Any, forward: Any, bf16: bool) -> Any:
    import torch

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = forward()
        loss.float().backward()
        model.zero_grad(set_to_none=True)

    return run


def retrieval_ceiling(cfg: Any, dataset: Any) -> dict[str, Any]:
    """Forward and backward of MiniLM + LoRA on one training batch: anchors, positives, one negative each."""
    import torch

    from lorafleet.train.dropout import use_fast_dropout
    from lorafleet.train.kinds.retrieval.trainer import _add_lora, load_base_model

    model = load_base_model(cfg.base_model, "cpu", cfg.max_seq_length)
    _add_lora(model, cfg)
    use_fast_dropout(model, "cpu", cfg.dropout_masks)  # the masks the training loop draws
    model.train()
    pairs = dataset.train_pairs()[: cfg.batch_size]
    texts = [[q for q, _ in pairs], [p for _, p in pairs], [p for _, p in pairs[1:] + pairs[:1]]]
    features = [model.tokenize(t) for t in texts]

    def forward() -> Any:
        q, *docs = (model(dict(f))["sentence_embedding"].float() for f in features)
        scores = cfg.scale * q @ torch.cat(docs).T
        return torch.nn.functional.cross_entropy(scores, torch.arange(len(q)))

    return {"batch": f"{len(pairs)} × 3 texts", **_alternate({p: _step(model, forward, p == "bf16")
                                                             for p in ("fp32", "bf16")})}


def generation_ceiling(cfg: Any, dataset: Any) -> dict[str, Any]:
    """Forward and backward of the causal LM + LoRA on one batch of training conversations, the LM head run
    only on the last 16 positions (as the trainer runs it only where labels are)."""
    import torch
    from peft import get_peft_model

    from lorafleet.train.dropout import use_fast_dropout
    from lorafleet.train.kinds.generation.causal_lm import load_causal_base
    from lorafleet.train.kinds.generation.trainer import lora_config

    model, tok = load_causal_base(cfg.base_model, "cpu", cfg.dtype, chat_template=cfg.chat_template)
    model = get_peft_model(model, lora_config(cfg))
    use_fast_dropout(model, "cpu", cfg.dropout_masks)
    model.train()
    convs = [row["messages"] for row in dataset.data["train"]][: cfg.batch_size]
    ids = [tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"][: cfg.max_length] for c in convs]
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])

    def forward() -> Any:
        logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False, logits_to_keep=17).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), input_ids[:, -16:])

    return {"batch": f"{len(ids)} × {width} tokens", **_alternate({p: _step(model, forward, p == "bf16")
                                                                   for p in ("fp32", "bf16")})}


# ---------------------------------------------------------------- one run (child process)


def run_one(kind: str, precision: str, config: Path, overrides: list[str], quick: bool, work: Path,
            threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    cfg = load_config(kind, config, overrides, quick, precision)
    out: dict[str, Any] = {"precision": precision, "loadavg_start": loadavg(), "torch_threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    if kind == "generation":
        from lorafleet.train.kinds.generation.run import build_generation_dataset
        from lorafleet.train.kinds.generation.trainer import train_generation

        dataset = build_generation_dataset(cfg)
        out["dataset_s"] = round(time.perf_counter() - t0, 1)
        result = train_generation(cfg, dataset, work / f"gen-{precision}", evaluate_test=True)
        keys = ("train_s", "train_cpu_s", "train_tokens_per_s", "train_steps", "train_examples", "epoch_eval_s",
                "dev_rouge_l", "test_rouge_l", "test_chrf", "test_exact_match", "test_pred_words")
        out["ceiling"] = generation_ceiling(cfg, dataset)
    else:
        from lorafleet.train import build_dataset, train_adapter

        dataset = build_dataset(cfg)
        out["dataset_s"] = round(time.perf_counter() - t0, 1)
        result = train_adapter(cfg, dataset, work / f"ret-{precision}", evaluate_test=True)
        keys = ("train_s", "train_cpu_s", "train_pairs", "dev_ndcg@10", "test_ndcg@10", "test_mrr@10",
                "test_recall@10")
        out["ceiling"] = retrieval_ceiling(cfg, dataset)
    out["training_precision"] = result.extras["training_precision"]
    out["dataset"] = dataset.summary()
    out["metrics"] = {k: result.metrics[k] for k in keys if k in result.metrics}
    out["train_wall_s"] = result.cost["wall_s"]  # the whole training function: mining/evaluation included
    out["train_loss"] = [round(e["train_loss"], 4) for e in result.epochs]
    out["loadavg_end"] = loadavg()
    return out


# ---------------------------------------------------------------- the comparison (parent)


def run(kind: str, precisions: list[str], config: Path, overrides: list[str], quick: bool, rounds: int,
        threads: int, work: Path, timeout_s: float) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        order = precisions if r % 2 == 0 else precisions[::-1]
        for precision in order:
            say(f"round {r + 1}: {kind} at {precision} (load average {loadavg()})…")
            out_file = work / f"{kind}-{precision}-{r}.json"
            argv = [sys.executable, "-m", "lorafleet.bench.train", "--kind", kind, "--precision-child", precision,
                    "--child-out", str(out_file), "--work", str(work), "--threads", str(threads),
                    "--config", str(config), *(f"--set={o}" for o in overrides), *(["--quick"] if quick else [])]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout_s,
                                      text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
            except subprocess.TimeoutExpired:
                runs.append({"precision": precision, "round": r, "error": f"did not finish within {timeout_s:.0f}s"})
                continue
            if proc.returncode != 0 or not out_file.exists():
                runs.append({"precision": precision, "round": r,
                             "error": f"exit {proc.returncode}: {proc.stdout[-1500:]}"})
                continue
            res = {**json.loads(out_file.read_text()), "round": r, "process_wall_s": round(time.perf_counter() - t0, 1)}
            say(f"  {precision}: train {res['metrics'].get('train_s')} s, {HEADLINE[kind]} "
                f"{res['metrics'].get(HEADLINE[kind])}, ceiling {res['ceiling']['speedup']}×")
            runs.append(res)
    return {"runs": runs, "summary": summarise(kind, runs)}


def summarise(kind: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per precision the medians over rounds; and bf16 against fp32: speed-ups and the headline's difference."""
    ok = [r for r in runs if "error" not in r]
    per: dict[str, dict[str, Any]] = {}
    for p in sorted({r["precision"] for r in ok}):
        mine = [r for r in ok if r["precision"] == p]

        def med(key: str, rows: list[dict[str, Any]] = mine) -> float | None:
            vals = [r["metrics"][key] for r in rows if key in r["metrics"]]
            return round(statistics.median(vals), 4) if vals else None

        per[p] = {"rounds": len(mine), "train_s": med("train_s"), "train_cpu_s": med("train_cpu_s"),
                  "train_wall_s": round(statistics.median(r["train_wall_s"] for r in mine), 1),
                  HEADLINE[kind]: med(HEADLINE[kind]),
                  "dev": med("dev_rouge_l" if kind == "generation" else "dev_ndcg@10"),
                  **({"train_tokens_per_s": med("train_tokens_per_s")} if kind == "generation" else {})}
    out: dict[str, Any] = {"per_precision": per}
    a, b = per.get("fp32"), per.get("bf16")
    if a and b:
        ratio = lambda k: round(a[k] / b[k], 2) if a.get(k) and b.get(k) else None  # noqa: E731
        ceilings = [r["ceiling"]["speedup"] for r in ok]
        cpu_ceilings = [r["ceiling"]["speedup_cpu"] for r in ok if "speedup_cpu" in r["ceiling"]]
        out.update({
            "bf16 speed-up, training loop (wall)": ratio("train_s"),
            "bf16 speed-up, training loop (CPU seconds)": ratio("train_cpu_s"),
            "bf16 speed-up, whole training function (wall)": ratio("train_wall_s"),
            "ceiling: bf16 speed-up of one forward+backward (median over runs)": round(statistics.median(ceilings), 2),
            "ceiling (CPU seconds)": round(statistics.median(cpu_ceilings), 2) if cpu_ceilings else None,
            f"bf16 − fp32 {HEADLINE[kind]}": round(b[HEADLINE[kind]] - a[HEADLINE[kind]], 4)
            if a[HEADLINE[kind]] is not None and b[HEADLINE[kind]] is not None else None,
        })
        if kind == "generation" and a.get("train_tokens_per_s") and b.get("train_tokens_per_s"):
            out["bf16 speed-up, training tokens/s"] = round(b["train_tokens_per_s"] / a["train_tokens_per_s"], 2)
    for arm, slow in per.items():  # `fp32:torch` beside `fp32`: what the fast dropout masks change
        precision, masks = parse_arm(arm)
        fast = per.get(precision)
        if masks != "torch" or fast is None:
            continue
        for key, label in (("train_s", "wall"), ("train_cpu_s", "CPU seconds")):
            if slow.get(key) and fast.get(key):
                out[f"{precision}: fast dropout masks speed-up, training loop ({label})"] = \
                    round(slow[key] / fast[key], 2)
        head = HEADLINE[kind]
        if slow[head] is not None and fast[head] is not None:
            out[f"{precision}: fast − torch masks {head}"] = round(fast[head] - slow[head], 4)
    old = per.get("fp32:torch")
    if old and b and old.get("train_s") and b.get("train_s"):
        out["bf16 with fast masks against fp32 with torch's (wall)"] = round(old["train_s"] / b["train_s"], 2)
    return out


def print_table(kind: str, result: dict[str, Any]) -> None:
    head = HEADLINE[kind]
    print(f"\n{'round':>5} {'precision':>9} {'train s':>8} {'train CPU s':>11} {'fn wall s':>9} {'ceiling':>8} "
          f"{head:>13} {'load':>12}")
    for r in result["runs"]:
        if "error" in r:
            print(f"{r['round'] + 1:>5} {r['precision']:>9} failed: {r['error'][:300]}")
            continue
        m = r["metrics"]
        print(f"{r['round'] + 1:>5} {r['precision']:>9} {fmt(m.get('train_s')):>8} {fmt(m.get('train_cpu_s')):>11} "
              f"{fmt(r['train_wall_s']):>9} {r['ceiling']['speedup']:>7}× {m.get(head, float('nan')):>13.4f} "
              f"{r['loadavg_start'][0]:>5}→{r['loadavg_end'][0]:<5}")
    for k, v in result["summary"].items():
        if k != "per_precision":
            print(f"{k}: {v}")
