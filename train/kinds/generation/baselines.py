"""The prompted baselines of the generation kind: what a user would pick instead of training a specialist.

* **k-shot** (`kshot_*`): the base model with `k` training examples in the prompt as prior turns
  (system, then k × (user = a section's text, assistant = its heading), then the example's own text).
  The k examples are drawn once, seeded by the dataset's seed, from the training split: every dev and
  test prompt carries the same ones, so nothing is tuned on dev or test.
* **other base, k-shot** (`other_kshot_*`): the same prompt on the other packaged base (SmolLM2-135M-Instruct
  ↔ gemma-3-270m), each rendered with its own chat template. A base that is not packaged has no "other"
  unless `baselines.other_model` names one.
* **best** (`best_*`): per metric, the best of every baseline of the run (lead, base, k-shot, other
  k-shot); the kind's gate requires a specialist to beat it by the margin.

A k-shot prompt that does not leave room for the answer in the model's context is refused with the
limit named, before anything is generated.

Baselines do not depend on the recipe being trained, only on the data, the bases' weights and the decoding, yet
they cost a third of a headings run on a CPU (~8 of ~25 min). `baselines_cache_key` names everything they depend
on; a run on the same key reuses the stored answers and metrics (`LORAFLEET_HOME/cache/generation-baselines`),
so trying a recipe twice costs one set of baselines (`baselines.cache: false` recomputes). The key holds a digest
of the code that builds prompts, decodes and scores (`BASELINES_CODE`, the files' bytes), the versions of the
metric libraries, and each base's converted folder (`base_identity`), so an entry never outlives what computed it
and nothing needs a manual bump.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lorafleet.models.causal
from lorafleet.core import settings
from lorafleet.core.metrics import key, prefixed
from lorafleet.models.causal import PACKAGED_GEMMA3, PACKAGED_SMOLLM2, CausalLMError, base_identity
from lorafleet.models.device import resolve_device
from lorafleet.train.kinds.generation.causal_lm import load_causal_base
from lorafleet.train.kinds.generation.evaluate import SCORE_METRICS, generate_answers, text_metrics
from lorafleet.train.kinds.generation.headings import HeadingExample, HeadingsDataset

log = logging.getLogger("lorafleet.train")

KSHOT = "kshot"  # prefix of the k-shot baseline's metrics (the run's own base)
OTHER_KSHOT = "other_kshot"  # prefix of the same prompt on the other packaged base
BEST = "best"  # prefix of the best baseline's metrics, per metric: what the gate compares against
# The system turn and the k shots are the same in every k-shot prompt: run once and cached when this long.
PREFIX_CACHE_MIN = 64
_OTHER_PACKAGED = {PACKAGED_SMOLLM2: PACKAGED_GEMMA3, PACKAGED_GEMMA3: PACKAGED_SMOLLM2}


class KShotOverflowError(CausalLMError):
    """A k-shot prompt plus the answer's budget does not fit the model's context."""


def other_model(base_model: str, setting: str | None) -> str | None:
    """The model of the other-base baseline: `auto` is the other packaged base (None for an unpackaged one)."""
    if setting is None:
        return None
    if setting == "auto":
        return _OTHER_PACKAGED.get(base_model)
    return setting


def kshot_examples(dataset: HeadingsDataset, k: int) -> list[HeadingExample]:
    """`k` training examples, drawn with the dataset's seed, in id order: the same for every prompt of a run."""
    train = dataset.examples["train"]
    if k > len(train):
        raise CausalLMError(f"baselines.kshot={k} needs {k} training examples; the training split has {len(train)}")
    seed = dataset.settings.get("seed", 0)
    return sorted(random.Random(f"{seed}:kshot").sample(train, k), key=lambda e: e.id)


def kshot_prompt(system_prompt: str, shots: Sequence[HeadingExample], text: str) -> list[dict[str, str]]:
    """System prompt, the shots as prior user/assistant turns, then `text` as the last user turn."""
    messages = [{"role": "system", "content": system_prompt}]
    for shot in shots:
        messages += [{"role": "user", "content": shot.input}, {"role": "assistant", "content": shot.heading}]
    return [*messages, {"role": "user", "content": text}]


def kshot_prompts(dataset: HeadingsDataset, split: str, shots: Sequence[HeadingExample]) -> list[list[dict[str, str]]]:
    return [kshot_prompt(dataset.system_prompt, shots, ex.input) for ex in dataset.examples[split]]


def model_context(model: Any) -> int | None:
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def check_context(tokenizer: Any, prompts: Sequence[list[dict[str, str]]], context: int | None, max_new_tokens: int,
                  *, model_name: str, k: int) -> int:
    """The longest rendered prompt's tokens; a KShotOverflowError naming the limit if it and the answer's
    budget do not fit `context`."""
    longest = max(len(tokenizer.apply_chat_template(p, tokenize=True, add_generation_prompt=True, return_dict=True)
                      ["input_ids"]) for p in prompts)
    if context is not None and longest + max_new_tokens > context:
        raise KShotOverflowError(
            f"the {k}-shot prompt for {model_name} has up to {longest} tokens; with max_new_tokens={max_new_tokens} "
            f"that exceeds the model's context of {context} tokens; lower train.baselines.kshot or "
            "data.input_max_tokens")
    return longest


def kshot_baseline(cfg: Any, dataset: HeadingsDataset, model_source: str, prefix: str,
                   splits: Sequence[str] = ("dev", "test"), *, chat_template: str | None = None
                   ) -> tuple[dict[str, float], dict[str, list[str]]]:
    """`{prefix}_{split}_{metric}` of the k-shot prompt on `model_source`, and its answers per split."""
    k = cfg.baselines.kshot
    shots = kshot_examples(dataset, k)
    prompts = {split: kshot_prompts(dataset, split, shots) for split in splits}
    model, tokenizer = load_causal_base(model_source, resolve_device(cfg.device), cfg.dtype,
                                        chat_template=chat_template)
    context = model_context(model)
    for split in splits:  # every split is checked before any is generated
        check_context(tokenizer, prompts[split], context, cfg.max_new_tokens, model_name=model_source, k=k)
    metrics: dict[str, float] = {}
    answers: dict[str, list[str]] = {}
    for split in splits:
        answers[split] = generate_answers(model, tokenizer, prompts[split], batch_size=cfg.eval_batch_size,
                                          max_new_tokens=cfg.max_new_tokens, description=f"{split}, {prefix}",
                                          prefix_cache_min=PREFIX_CACHE_MIN)
        metrics.update(prefixed(text_metrics(answers[split], dataset.references(split), split), prefix))
    return metrics, answers


# The layout of a cache entry; what a baseline computes is covered by BASELINES_CODE (no bump needed for that).
BASELINES_CACHE_VERSION = 2
_HERE = Path(__file__).parent
# The modules whose bytes key the cache: prompts and the lead (here, run, headings), loading and converting a
# base (causal_lm, lorafleet/models/causal), decoding and scoring (evaluate, trainer).
BASELINES_CODE: tuple[Path, ...] = (
    *(_HERE / f"{name}.py" for name in ("baselines", "run", "evaluate", "trainer", "headings", "causal_lm")),
    Path(lorafleet.models.causal.__file__),
)
# Distributions whose numbers the metrics are (rouge-score's LCS, sacrebleu's chrF).
METRIC_LIBRARIES = ("rouge-score", "sacrebleu")


def code_digest(files: Sequence[Path]) -> str:
    """sha256 over the names and bytes of `files`: any edit to them changes it."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0".encode() + f.read_bytes() + b"\0")
    return h.hexdigest()


def library_versions(names: Sequence[str]) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out


def baselines_cache_key(cfg: Any, dataset: HeadingsDataset, other: str | None, splits: Sequence[str]
                        ) -> dict[str, Any] | None:
    """Everything the baselines of `cfg` on `dataset` depend on, or None when a base has no content digest
    (a hub id): the dataset digest (data, system prompt, input cut), each base's converted folder
    (`base_identity`: the GGUF and the converter, or the folder's files), the base's chat template, k, the
    decoding settings, device, dtype, a digest of the code that prompts, decodes and scores (`BASELINES_CODE`),
    the metric libraries' versions and the lorafleet/torch/transformers versions (their numerics)."""
    import torch
    import transformers

    import lorafleet

    models = {"base": base_identity(cfg.base_model)}
    if other is not None:
        models["other"] = base_identity(other)
    if any(v is None for v in models.values()):
        return None
    return {
        "version": BASELINES_CACHE_VERSION, "dataset": dataset.digest, "splits": list(splits), "models": models,
        "chat_template": cfg.chat_template, "kshot": cfg.baselines.kshot, "other_model": other,
        "max_new_tokens": cfg.max_new_tokens, "eval_batch_size": cfg.eval_batch_size,
        "device": resolve_device(cfg.device), "dtype": str(cfg.dtype), "lorafleet": lorafleet.__version__,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "code": code_digest(BASELINES_CODE), "metric_libraries": library_versions(METRIC_LIBRARIES),
    }


def baselines_cache_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return settings.home() / "cache" / "generation-baselines" / f"{digest}.json"


def load_cached_baselines(key: dict[str, Any]) -> dict[str, Any] | None:
    """The stored entry for `key`, or None (none stored, unreadable, or stored under another key)."""
    path = baselines_cache_path(key)
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable baselines cache %s (%s); recomputing", path, e)
        return None
    return entry if isinstance(entry, dict) and entry.get("key") == key else None


def store_cached_baselines(key: dict[str, Any], entry: dict[str, Any]) -> Path:
    """Write `entry` under `key` atomically (a run killed mid-write leaves no half file to reuse)."""
    path = baselines_cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**entry, "key": key}, ensure_ascii=False))
    os.replace(tmp, path)
    return path


def best_baseline(metrics: dict[str, float], prefixes: Sequence[str], splits: Sequence[str] = ("dev", "test")
                  ) -> dict[str, float]:
    """`best_{split}_{metric}`: per score metric, the highest of the baselines `prefixes` that have it."""
    out: dict[str, float] = {}
    for split in splits:
        for name in SCORE_METRICS:
            values = [metrics[f"{p}_{key(split, name)}"] for p in prefixes if f"{p}_{key(split, name)}" in metrics]
            if values:
                out[f"{BEST}_{key(split, name)}"] = max(values)
    return out


def best_label(metrics: dict[str, float], prefixes: Sequence[str], split: str = "test", name: str = "rouge_l") -> str:
    """Which baseline is best on `split`'s `name` (the first of equals)."""
    scored = [(metrics[f"{p}_{key(split, name)}"], -i, p) for i, p in enumerate(prefixes)
              if f"{p}_{key(split, name)}" in metrics]
    return max(scored)[2] if scored else ""


__all__ = [
    "BASELINES_CACHE_VERSION", "BASELINES_CODE", "BEST", "KSHOT", "METRIC_LIBRARIES", "OTHER_KSHOT",
    "KShotOverflowError", "baselines_cache_key", "baselines_cache_path", "best_baseline", "best_label",
    "check_context", "code_digest", "kshot_baseline", "kshot_examples", "kshot_prompt", "kshot_prompts",
    "library_versions", "load_cached_baselines", "model_context", "other_model", "store_cached_baselines",
]
