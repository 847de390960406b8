"""One full headings run: dataset, baselines (lead, base, k-shot, other base k-shot), LoRA, evaluation, report.md.

MLflow, the CLI and research wire these functions in from outside; nothing here logs to MLflow.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from lorafleet.core.metrics import prefixed
from lorafleet.core.tasks import EpochCallback, TrainResult
from lorafleet.models.device import resolve_device
from lorafleet.train.kinds.generation.baselines import (
    BEST,
    KSHOT,
    OTHER_KSHOT,
    baselines_cache_key,
    baselines_cache_path,
    best_baseline,
    best_label,
    kshot_baseline,
    load_cached_baselines,
    other_model,
    store_cached_baselines,
)
from lorafleet.train.kinds.generation.byo import GenerationDatasetData, build_byo_generation
from lorafleet.train.kinds.generation.causal_lm import (
    base_identity,
    describe_base,
    load_causal_adapter,
    load_causal_base,
    load_causal_tokenizer,
)
from lorafleet.train.kinds.generation.evaluate import (
    TEXT_METRICS,
    exact_match_reach,
    examples_table,
    fit_lead_length,
    lead_baseline,
    text_metrics,
)
from lorafleet.train.kinds.generation.headings import HeadingsDataConfig, HeadingsDataset, build_headings
from lorafleet.train.kinds.generation.trainer import GenerationTrainConfig, evaluate_split, train_generation
from lorafleet.train.run import KindRun, run_kind, save_report

log = logging.getLogger("lorafleet.train")

LEAD = "lead"  # prefix of the non-learned baseline's metrics
TASK = "generation"


@dataclass
class Baselines:
    """`lead_*`, `base_*`, `kshot_*`, `other_kshot_*` and `best_*` metrics on dev and test, the answers,
    the lead's length in words and the other base's name."""

    metrics: dict[str, float]
    predictions: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # baseline → split → answers
    lead_words: int = 0
    other_model: str | None = None
    cached: str | None = None  # the cache file they were reused from (None: computed by this run)
    seconds: float = 0.0  # what computing them took (in the run that did)

    @property
    def names(self) -> list[str]:
        """The baselines this run has, in table order."""
        return [p for p in (LEAD, "base", KSHOT, OTHER_KSHOT) if p in self.predictions]


def build_generation_dataset(cfg: GenerationTrainConfig, *, data_root: Path | None = None,
                             tokenizer: Any = None) -> HeadingsDataset:
    """The headings dataset, inputs cut with the base model's own tokenizer."""
    tok = tokenizer if tokenizer is not None else load_causal_tokenizer(cfg.base_model, cfg.chat_template)
    if isinstance(cfg.data, GenerationDatasetData):
        return build_byo_generation(cfg.data, tok)
    return build_headings(cfg.data, tok, data_root=data_root)


def generation_baselines(cfg: GenerationTrainConfig, dataset: HeadingsDataset,
                         splits: tuple[str, ...] = ("dev", "test")) -> Baselines:
    """The lead baseline, the base model, its k-shot prompt and the other base's, decoded like the LoRA, on
    `splits`; `best_*` is the best of them per metric (what the gate compares against). Reused from an earlier
    run with the same `baselines_cache_key` unless `baselines.cache` is off."""
    other = other_model(cfg.base_model, cfg.baselines.other_model) if cfg.baselines.kshot > 0 else None
    key = baselines_cache_key(cfg, dataset, other, splits) if cfg.baselines.cache else None
    if cfg.baselines.cache and key is None:
        hub = [m for m in (cfg.base_model, other) if m is not None and base_identity(m) is None]
        log.info("baselines: not stored for reuse, as %s names a hub model whose weights can change upstream",
                 " and ".join(hub))
    entry = load_cached_baselines(key) if key is not None else None
    if entry is not None:
        out = Baselines(metrics=entry["metrics"], predictions=entry["predictions"], lead_words=entry["lead_words"],
                        other_model=entry["other_model"], cached=str(baselines_cache_path(key)),
                        seconds=entry["seconds"])
        log.info("baselines reused from an earlier run with the same data, bases and decoding (%s; computing them "
                 "took %.0f s); `--set baselines.cache=false` recomputes them", out.cached, out.seconds)
        return out
    out = _compute_baselines(cfg, dataset, splits, other)
    if key is not None:
        store_cached_baselines(key, {"metrics": out.metrics, "predictions": out.predictions,
                                     "lead_words": out.lead_words, "other_model": out.other_model,
                                     "seconds": out.seconds})
    return out


def _compute_baselines(cfg: GenerationTrainConfig, dataset: HeadingsDataset, splits: tuple[str, ...],
                       other: str | None) -> Baselines:
    train = dataset.examples["train"]
    n = fit_lead_length([ex.input for ex in train], [ex.heading for ex in train])
    out = Baselines(metrics={}, predictions={"lead": {}, "base": {}}, lead_words=n)
    for split in splits:
        answers = lead_baseline([ex.input for ex in dataset.examples[split]], n)
        out.predictions["lead"][split] = answers
        out.metrics.update(prefixed(text_metrics(answers, dataset.references(split), split), LEAD))
    t0 = time.perf_counter()
    model, tokenizer = load_causal_base(cfg.base_model, resolve_device(cfg.device), cfg.dtype,
                                        chat_template=cfg.chat_template)
    for split in splits:
        m, out.predictions["base"][split] = evaluate_split(cfg, model, tokenizer, dataset, split, f"{split}, base")
        out.metrics.update(prefixed(m, "base"))
    del model  # one base in memory at a time
    if cfg.baselines.kshot > 0:
        m, out.predictions[KSHOT] = kshot_baseline(cfg, dataset, cfg.base_model, KSHOT, splits,
                                                   chat_template=cfg.chat_template)
        out.metrics.update(m)
        out.other_model = other
        if out.other_model is not None:
            m, out.predictions[OTHER_KSHOT] = kshot_baseline(cfg, dataset, out.other_model, OTHER_KSHOT, splits)
            out.metrics.update(m)
    out.metrics.update(best_baseline(out.metrics, out.names, splits))
    out.seconds = round(time.perf_counter() - t0, 1)
    log.info("baselines (test ROUGE-L): %s; best %s (%.0f s)", ", ".join(
        f"{p} {out.metrics.get(f'{p}_test_rouge_l', float('nan')):.4f}" for p in out.names),
        best_label(out.metrics, out.names), out.seconds)
    return out


def evaluate_generation_adapter(cfg: GenerationTrainConfig, dataset: HeadingsDataset, adapter_dir: Path,
                                split: str) -> dict[str, float]:
    """The adapter's metrics on `split`, named `{split}_{metric}` (no prefix)."""
    model, tokenizer = load_causal_adapter(cfg.base_model, adapter_dir, resolve_device(cfg.device), cfg.dtype,
                                           chat_template=cfg.chat_template)
    return evaluate_split(cfg, model, tokenizer, dataset, split, f"{split}, LoRA")[0]


def bundle_details(cfg: GenerationTrainConfig) -> dict[str, Any]:
    """What serving needs besides the adapter to pose the same task: the base, its chat template, the
    system prompt, the input budget and the decoding settings (greedy, first line of the answer)."""
    tokenizer = load_causal_tokenizer(cfg.base_model, cfg.chat_template)
    return {
        "base": describe_base(cfg.base_model),
        "chat_template": tokenizer.chat_template,
        "system_prompt": cfg.data.system_prompt,
        "input_max_tokens": cfg.data.input_max_tokens,
        "max_new_tokens": cfg.max_new_tokens,
        "decoding": "greedy; the answer is the first non-empty line",
    }


def relative_lift(metrics: dict[str, float], split: str = "test", metric: str = "rouge_l", ref: str = BEST) -> float:
    base = metrics.get(f"{ref}_{split}_{metric}", 0.0)
    return (metrics[f"{split}_{metric}"] - base) / base if base > 0 else float("nan")


def example_rows(dataset: HeadingsDataset, baselines: Baselines, lora: list[str], split: str = "test",
                 n: int = 10) -> list[dict[str, str]]:
    """`n` seeded-random examples of `split`: section, truth, each baseline, LoRA."""
    exs = dataset.examples[split]
    idx = sorted(random.Random(f"{dataset.settings['seed']}:examples").sample(range(len(exs)), min(n, len(exs))))
    return [{"section": exs[i].id, "truth": exs[i].heading,
             **{p: baselines.predictions[p][split][i] for p in baselines.names}, "LoRA": lora[i]} for i in idx]


def reach_metrics(dataset: HeadingsDataset) -> dict[str, float]:
    """`{split}_exact_match_reach[_train|_input]` for dev and test: what copying could match (exact_match_reach)."""
    out: dict[str, float] = {}
    for split in ("dev", "test"):
        inputs = [ex.input for ex in dataset.examples[split]]
        reach = exact_match_reach(dataset.references(split), inputs, dataset.references("train"))
        out.update({f"{split}_exact_match_{k}": v for k, v in reach.items()})
    return out


def write_generation_report(path: Path, cfg: GenerationTrainConfig, dataset: HeadingsDataset,
                            result: TrainResult, baselines: Baselines) -> Path:
    m, c = result.metrics, result.cost
    base = result.extras.get("base", {})
    lines = [
        "# Headings LoRA report",
        "",
        f"- base model: `{cfg.base_model}`" + (f" (GGUF `{base['gguf_file']}`, {base.get('quantization')}, "
                                               f"dequantised; sha256 `{base['gguf_sha256'][:16]}…`)"
                                               if "gguf_file" in base else "") + f", device {result.extras['device']}, "
        f"training precision {result.extras.get('training_precision', 'fp32')}",
        (f"- laws: {', '.join(cfg.data.laws)}; " if isinstance(cfg.data, HeadingsDataConfig) else
         f"- your data, layout `{cfg.data.layout}`: `{cfg.data.rows.label()}`; ")
        + f"input ≤ {cfg.data.input_max_tokens} tokens; "
        f"max_new_tokens {cfg.max_new_tokens}",
        f"- dataset digest: `{dataset.digest}`",
        "- dataset: " + ", ".join(f"{k} {v}" for k, v in dataset.summary().items()),
        *([f"- exact-match reach (test): {m['test_exact_match_reach_train']:.1%} of the headings equal a training "
           f"heading, {m['test_exact_match_reach_input']:.1%} appear word for word in their input, "
           f"{m['test_exact_match_reach']:.1%} either: about the most exact match a model that copies can get"]
          if "test_exact_match_reach" in m else []),
        f"- LoRA r={cfg.lora.r} alpha={cfg.lora.alpha} dropout={cfg.lora.dropout} targets={cfg.lora.target_modules}; "
        f"lr {cfg.learning_rate}, epochs {cfg.epochs}, batch {cfg.batch_size}×{cfg.gradient_accumulation_steps}, "
        f"packing {cfg.packing}; {int(m.get('trainable_params', 0)):,} trainable parameters, "
        f"adapter {m.get('adapter_size_mb', float('nan')):.1f} MB",
        *([f"- baselines reused from an earlier run with the same data, bases and decoding (`{baselines.cached}`; "
           f"computing them took {baselines.seconds:.0f} s)"] if baselines.cached else []),
        f"- lead baseline: the section's first {baselines.lead_words} words (the length with the best ROUGE-L on the "
        "training split)",
        (f"- k-shot: {cfg.baselines.kshot} training examples as prior turns, on `{cfg.base_model}`"
         + (f" and on `{baselines.other_model}` (other kshot)" if baselines.other_model else "")
         if KSHOT in baselines.names else "- k-shot: off"),
        "",
        "Greedy decoding; the answer is the first line of the output. The headline is ROUGE-L: mean F1 over "
        "casefolded words; chrF (β = 2, sacrebleu corpus chrF, 0–100) and chrF1 (β = 1) are reported beside it: "
        "β = 2 favours long answers on short headings. Exact match after casefolding and trimming punctuation; "
        "pred_words: mean answer length in words. The gate: the LoRA must beat the best baseline by the margin.",
        "",
    ]
    names = baselines.names
    for split in ("dev", "test"):
        lines += [f"## {split}", "", "| metric | " + " | ".join(n.replace("_", " ") for n in names)
                  + " | LoRA | LoRA vs best |", "|---|" + "---|" * (len(names) + 2)]
        for name in TEXT_METRICS:
            key = f"{split}_{name}"
            if key in m:
                b = m.get(f"{BEST}_{key}", float("nan"))
                lift = (m[key] - b) / b * 100 if b else float("nan")
                lines.append(f"| {name} | " + " | ".join(f"{m.get(f'{p}_{key}', float('nan')):.4f}" for p in names)
                             + f" | {m[key]:.4f} | " + (f"{lift:+.1f} % |" if name != "pred_words" else "|"))
        lines.append("")
    preds = result.extras.get("predictions", {})
    if "test" in preds:
        rows = example_rows(dataset, baselines, preds["test"])
        lines += ["## Examples (test)", "", examples_table(rows, ["section", "truth", *names, "LoRA"]), ""]
    lines += ["## Epochs", "", "| epoch | train loss | dev ROUGE-L | dev chrF | dev exact match |",
              "|---|---|---|---|---|"]
    lines += [f"| {int(e['epoch'])} | {e['train_loss']:.4f} | {e.get('dev_rouge_l', float('nan')):.4f} | "
              f"{e.get('dev_chrf', float('nan')):.2f} | {e.get('dev_exact_match', float('nan')):.4f} |"
              for e in result.epochs]
    lines.append("")
    return save_report(path, lines, c, cfg.price_per_hour_usd,
                       f"; training {m.get('train_s', 0):.0f} s at {m.get('train_tokens_per_s', 0):.0f} tokens/s "
                       f"({int(m.get('torch_threads', 0))} torch threads)")


class GenerationRun(KindRun):
    task: ClassVar[str] = TASK
    out_prefix: ClassVar[str] = "headings"
    found: Baselines | None = None

    def build_dataset(self) -> HeadingsDataset:
        return build_generation_dataset(self.cfg)

    def baselines(self, dataset: HeadingsDataset) -> dict[str, float]:
        self.found = generation_baselines(self.cfg, dataset)
        return self.found.metrics

    def train(self, dataset: HeadingsDataset, out: Path, on_epoch: EpochCallback | None, *,
              evaluate_test: bool) -> TrainResult:
        return train_generation(self.cfg, dataset, out, on_epoch=on_epoch, evaluate_test=evaluate_test)

    def finish(self, result: TrainResult, dataset: HeadingsDataset, out: Path) -> None:
        assert self.found is not None
        found = self.found
        result.metrics.update(reach_metrics(dataset))
        for split in ("dev", "test"):
            result.metrics[f"{split}_rouge_l_lift"] = relative_lift(result.metrics, split)
        result.extras["lead_words"] = found.lead_words
        test_preds = result.extras["predictions"]["test"]
        with (out / "predictions.jsonl").open("w") as f:
            for i, ex in enumerate(dataset.examples["test"]):
                f.write(json.dumps({"id": ex.id, "truth": ex.heading,
                                    **{p: found.predictions[p]["test"][i] for p in found.names},
                                    "lora": test_preds[i]}, ensure_ascii=False) + "\n")

    def report(self, path: Path, dataset: HeadingsDataset, result: TrainResult) -> Path:
        assert self.found is not None
        return write_generation_report(path, self.cfg, dataset, result, self.found)

    def details(self, result: TrainResult, dataset: HeadingsDataset) -> dict[str, Any]:
        assert self.found is not None
        return {"stages": result.extras["stages"],
                "base": result.extras.get("base") or describe_base(self.cfg.base_model),
                "lead_words": self.found.lead_words, "other_model": self.found.other_model,
                "baselines_cached": self.found.cached}

    def done(self, result: TrainResult, out: Path) -> None:
        m = result.metrics
        names = self.found.names if self.found is not None else []
        log.info("done: test_rouge_l %.4f (best baseline %.4f: %s; lift %+.1f %%; chrF %.2f) in %.0f s → %s",
                 m["test_rouge_l"], m.get("best_test_rouge_l", float("nan")), best_label(m, names),
                 100 * m["test_rouge_l_lift"], m["test_chrf"], result.cost["wall_s"], out)


def run_generation_train(cfg: GenerationTrainConfig, out_dir: Path | None = None, *, log_mlflow: bool = False,
                         run_name: str | None = None) -> TrainResult:
    """Dataset → baselines → LoRA → evaluation; writes train_config.yaml, metrics.json, predictions.jsonl, report.md.

    With `log_mlflow`, the run is tracked like a retrieval run (experiment `lorafleet-train`, or a child of the
    active run): config, dataset input, baselines, the objective per epoch, the result and its artifacts.
    """
    return run_kind(GenerationRun(cfg), out_dir, log_mlflow=log_mlflow, run_name=run_name)


__all__ = [
    "LEAD", "Baselines", "build_generation_dataset", "bundle_details", "evaluate_generation_adapter", "example_rows",
    "generation_baselines", "reach_metrics", "relative_lift", "run_generation_train", "write_generation_report",
]
