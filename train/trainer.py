"""LoRA training of a sentence-transformers model with peft, evaluated on dev after every epoch."""

from __future__ import annotations

import json
import logging
import resource
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lorafleet.config import ConfigError
from lorafleet.device import resolve_device
from lorafleet.models import resolve_model_source
from lorafleet.progress import StepProgress, quiet_library_bars
from lorafleet.tasks import EpochCallback, TrainResult
from lorafleet.train.config import TrainConfig, resolve_training_precision
from lorafleet.train.dataset import RetrievalDataset
from lorafleet.train.dropout import use_fast_dropout
from lorafleet.train.evaluate import DenseEvaluator

log = logging.getLogger("lorafleet.train")

class CostMeter:
    """Wall and CPU seconds since creation, the process's peak RSS, and dollars at a price per hour."""

    def __init__(self, price_per_hour_usd: float) -> None:
        self.price = price_per_hour_usd
        self._wall = time.perf_counter()
        self._cpu = self._cpu_now()

    @staticmethod
    def _cpu_now() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    def read(self) -> dict[str, float]:
        wall = time.perf_counter() - self._wall
        return {
            "wall_s": round(wall, 2),
            "cpu_s": round(self._cpu_now() - self._cpu, 2),
            # ru_maxrss is in KiB on Linux; it is the process's peak, which is the run's peak in a CLI run.
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "usd": round(wall / 3600 * self.price, 5),
        }


class ProgressEncoder:
    """A sentence-transformers model whose `encode` shows progress on long inputs (a corpus takes a minute or
    more on a CPU): it encodes slices of `SLICE_BATCHES` batches and advances a StepProgress after each.
    Short inputs (queries) go through at once; every other attribute is the model's."""

    SLICE_BATCHES = 8

    def __init__(self, model: Any, description: str) -> None:
        self._model, self._description = model, description

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def encode(self, sentences: Any, *args: Any, batch_size: int = 32, **kwargs: Any) -> Any:
        step = max(1, batch_size) * self.SLICE_BATCHES
        if isinstance(sentences, str) or len(sentences) <= step:
            return self._model.encode(sentences, *args, batch_size=batch_size, **kwargs)
        texts = list(sentences)
        parts = []
        with StepProgress(len(texts), self._description) as bar:
            for i in range(0, len(texts), step):
                parts.append(self._model.encode(texts[i : i + step], *args, batch_size=batch_size, **kwargs))
                bar.advance(len(texts[i : i + step]))
        return _concat(parts)


def _concat(parts: list[Any]) -> Any:
    import numpy as np

    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    if isinstance(parts[0], list):
        return [x for part in parts for x in part]
    import torch

    return torch.cat(parts)


@contextmanager
def float32_forward(model: Any) -> Iterator[Any]:
    """`model` with its own forward for the block: under mixed precision, accelerate wraps the trained module's
    `forward` in autocast on the instance (and leaves it there after training), so an evaluation that runs
    through it (sentence-transformers' `encode` does) would score at bf16; inside, it scores at float32."""
    wrapped, original = model.__dict__.get("forward"), model.__dict__.get("_original_forward")
    if wrapped is None or original is None:
        yield model
        return
    model.forward = original
    try:
        yield model
    finally:
        model.forward = wrapped


def drop_autocast(model: Any) -> None:
    """Undo accelerate's autocast wrapper on `model` for good (after training: the model is evaluated, saved
    and handed on at float32, as an fp32-trained one)."""
    original = model.__dict__.pop("_original_forward", None)
    if original is not None:
        model.__dict__.pop("forward", None)


def load_base_model(base_model: str, device: str = "cpu", max_seq_length: int | None = None) -> Any:
    from sentence_transformers import SentenceTransformer

    quiet_library_bars()  # "Loading weights" and the like would be fragments in a log
    model = SentenceTransformer(resolve_model_source(base_model), device=device)
    if max_seq_length is not None:
        model.max_seq_length = max_seq_length
    return model


def load_adapter_model(
    base_model: str, adapter_dir: Path, device: str = "cpu", max_seq_length: int | None = None
) -> Any:
    """A fresh base model with the adapter from `adapter_dir` loaded and active.

    The base comes from `base_model` (resolved like everywhere in lorafleet), never from the path
    recorded in `adapter_config.json`, so an adapter trained on another machine loads here.
    """
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter_dir} is not a peft adapter directory (no adapter_config.json)")
    model = load_base_model(base_model, device, max_seq_length)
    model.load_adapter(str(adapter_dir))
    model.eval()
    return model


def mine_negatives(
    cfg: TrainConfig, dataset: RetrievalDataset, model: Any
) -> tuple[list[tuple[str, str, list[str]]], int]:
    """(query, positive, negatives) for every training query, mined with the (base) `model`, and how many
    queries got random instead of mined negatives.

    `sentence_transformers.util.mine_hard_negatives` keeps a candidate only if it scores below the
    positive's score minus `negative_margin` (so near-duplicate sections, which statutes are full of,
    are never pushed away) and takes the best-scoring such candidates among the top
    `negative_range_max` (None: all). Candidates are the first chunks of *training* sections, so no
    other chunk of the positive's own section and no held-out section is ever a negative. A query the
    miner cannot serve (its positive scores below nearly every candidate) gets seeded random
    training-section negatives instead, so no training query is lost; their count is reported.
    """
    key = (cfg.base_model, cfg.max_seq_length, cfg.data.num_negatives, cfg.data.negative_margin,
           cfg.data.negative_range_max, cfg.seed, dataset.digest)
    if key in dataset.negatives_cache:
        return dataset.negatives_cache[key]
    import random

    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives

    pairs = dataset.train_pairs()
    train_sections = sorted({dataset.query_info[q].section_id for q in dataset.queries["train"]})
    candidates = sorted({dataset.first_chunk(s).text for s in train_sections})
    n = cfg.data.num_negatives
    if len(candidates) <= n + 1:
        raise ConfigError(f"only {len(candidates)} training sections: too few to mine {n} hard negatives each")
    range_max = cfg.data.negative_range_max or len(candidates)
    mined = mine_hard_negatives(
        Dataset.from_dict({"anchor": [q for q, _ in pairs], "positive": [p for _, p in pairs]}),
        model,
        corpus=candidates,
        range_max=min(max(range_max, n + 1), len(candidates) - 1),
        absolute_margin=cfg.data.negative_margin,
        num_negatives=n,
        sampling_strategy="top",
        output_format="n-tuple",
        batch_size=cfg.eval_batch_size,
        verbose=False,
    )
    neg_cols = [c for c in mined.column_names if c.startswith("negative")]
    found = {(r["anchor"], r["positive"]): [r[c] for c in neg_cols] for r in mined}
    rng = random.Random(cfg.seed)
    rows, n_random = [], 0
    for q, p in pairs:
        negs = found.get((q, p))
        if negs is None:
            negs = rng.sample([c for c in candidates if c != p], n)
            n_random += 1
        rows.append((q, p, negs))
    dataset.negatives_cache[key] = (rows, n_random)
    return rows, n_random


def pairs_loss(model: Any, pairs: list[tuple[str, str]], batch_size: int, scale: float = 20.0) -> float:
    """Mean in-batch MNRL loss of `model` on fixed, unshuffled batches of (query, positive) pairs.

    A deterministic yardstick (no dropout, no sampling) to compare a model before and after training.
    """
    import torch
    import torch.nn.functional as F

    losses: list[float] = []
    for i in range(0, len(pairs), batch_size):
        batch = pairs[i : i + batch_size]
        if len(batch) < 2:
            continue
        q = model.encode([p[0] for p in batch], convert_to_tensor=True, normalize_embeddings=True,
                         show_progress_bar=False)
        d = model.encode([p[1] for p in batch], convert_to_tensor=True, normalize_embeddings=True,
                         show_progress_bar=False)
        logits = scale * q @ d.T
        losses.append(float(F.cross_entropy(logits, torch.arange(len(batch), device=logits.device))))
    if not losses:
        raise ValueError("need at least two pairs to compute an in-batch loss")
    return sum(losses) / len(losses)


def _train_dataset(cfg: TrainConfig, dataset: RetrievalDataset, model: Any) -> tuple[Any, dict[str, float]]:
    from datasets import Dataset

    pairs = dataset.train_pairs()
    if dataset.given_negatives and not cfg.data.hard_negatives:
        return _given_negatives(cfg, dataset, pairs)
    if not cfg.data.hard_negatives:
        data = {"anchor": [q for q, _ in pairs], "positive": [p for _, p in pairs]}
        return Dataset.from_dict(data), {"train_pairs": len(pairs), "train_negatives": 0,
                                         "train_random_negative_queries": 0}
    t0 = time.perf_counter()
    rows, n_random = mine_negatives(cfg, dataset, model)
    data: dict[str, list[str]] = {"anchor": [r[0] for r in rows], "positive": [r[1] for r in rows]}
    for i in range(cfg.data.num_negatives):
        data[f"negative_{i + 1}"] = [r[2][i] for r in rows]
    log.info("hard negatives: %d per query, mined for %d of %d training queries, random for the rest (%.0f s)",
             cfg.data.num_negatives, len(rows) - n_random, len(pairs), time.perf_counter() - t0)
    return Dataset.from_dict(data), {"train_pairs": len(rows), "train_negatives": cfg.data.num_negatives,
                                     "train_random_negative_queries": n_random}


def _given_negatives(cfg: TrainConfig, dataset: RetrievalDataset, pairs: list[tuple[str, str]]
                     ) -> tuple[Any, dict[str, float]]:
    """Training triples with the negatives that came with the data; a query without enough gets seeded random
    training documents for the rest, so every row has `num_negatives` (counted in the stats)."""
    import random

    from datasets import Dataset

    n = cfg.data.num_negatives
    rng = random.Random(cfg.seed)
    pool = sorted({p for _, p in pairs})
    rows: dict[str, list[str]] = {"anchor": [], "positive": []}
    for i in range(n):
        rows[f"negative_{i + 1}"] = []
    filled = 0
    for qid, (q, p) in zip(dataset.queries["train"], pairs, strict=True):
        negs = [x for x in dataset.given_negatives.get(qid, []) if x != p][:n]
        if len(negs) < n:
            filled += 1
            negs += rng.sample([c for c in pool if c != p and c not in negs], n - len(negs))
        rows["anchor"].append(q)
        rows["positive"].append(p)
        for i, neg in enumerate(negs):
            rows[f"negative_{i + 1}"].append(neg)
    return Dataset.from_dict(rows), {"train_pairs": len(pairs), "train_negatives": n,
                                     "train_random_negative_queries": filled}


def _add_lora(model: Any, cfg: TrainConfig) -> None:
    from peft import LoraConfig, TaskType

    lora = LoraConfig(
        task_type=TaskType.FEATURE_EXTRACTION, r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout, target_modules=list(cfg.lora.target_modules),
    )
    try:
        model.add_adapter(lora)
    except ValueError as exc:
        raise ConfigError(f"lora.target_modules={cfg.lora.target_modules} do not fit {cfg.base_model}: {exc}") from exc


def save_adapter(model: Any, adapter_dir: Path, base_model: str) -> Path:
    """Write the sentence-transformers model's adapter in peft format (see save_peft_adapter)."""
    return save_peft_adapter(model[0].auto_model, adapter_dir, base_model)


def save_peft_adapter(peft_model: Any, adapter_dir: Path, base_model: str) -> Path:
    """Write only the adapter (peft format); record the base as configured, not as this machine's path."""
    adapter_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(adapter_dir))
    cfg_path = adapter_dir / "adapter_config.json"
    if not cfg_path.is_file() or not (adapter_dir / "adapter_model.safetensors").is_file():
        raise RuntimeError(f"saving the adapter to {adapter_dir} did not produce the peft files")
    adapter_cfg = json.loads(cfg_path.read_text())
    adapter_cfg["base_model_name_or_path"] = base_model
    cfg_path.write_text(json.dumps(adapter_cfg, indent=2, sort_keys=True) + "\n")
    return adapter_dir


def train_adapter(
    cfg: TrainConfig,
    dataset: RetrievalDataset,
    out_dir: Path,
    *,
    on_epoch: EpochCallback | None = None,
    keep_model: bool = False,
    evaluate_test: bool = False,
) -> TrainResult:
    """Train a LoRA adapter on `dataset`'s training queries; evaluate dev after each epoch.

    `on_epoch(epoch, dev_metrics)` is called after every epoch's dev evaluation (epochs count from 1);
    whatever it raises (e.g. `optuna.TrialPruned`) propagates out of this function. The adapter
    lands in `out_dir/adapter`. Costs cover this function only. `keep_model` puts the trained
    in-memory model into `result.extras["model"]`. Test is scored only with `evaluate_test` (a standalone
    run): research trials see dev only, and research scores test once, for its winner.
    """
    import torch
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        MultipleNegativesRankingLoss,
    )
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers
    from transformers import PrinterCallback, TrainerCallback, set_seed

    meter = CostMeter(cfg.price_per_hour_usd)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    precision = resolve_training_precision(cfg.precision, device)  # before any work: a bad setting fails now
    set_seed(cfg.seed)
    model = load_base_model(cfg.base_model, device, cfg.max_seq_length)
    train_data, data_stats = _train_dataset(cfg, dataset, model)
    _add_lora(model, cfg)
    swapped = use_fast_dropout(model, device, cfg.dropout_masks)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    if cfg.loss == "cached_mnrl":
        loss = CachedMultipleNegativesRankingLoss(model, scale=cfg.scale, mini_batch_size=cfg.mini_batch_size)
    else:
        loss = MultipleNegativesRankingLoss(model, scale=cfg.scale)

    evaluator = DenseEvaluator(dataset, cfg.eval_batch_size)
    epochs: list[dict[str, float]] = []
    step_losses: list[tuple[float, float]] = []  # (epoch position, loss)
    bars: list[StepProgress] = []  # the training steps' display, closed however training ends
    eval_s: list[tuple[float, float]] = []  # wall and CPU seconds of each epoch's dev evaluation (in trainer.train)

    class _EpochEval(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            bars.append(StepProgress(state.max_steps, "train"))

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any) -> None:
            if logs and "loss" in logs:
                step_losses.append((float(state.epoch or 0), float(logs["loss"])))
                if bars:
                    bars[-1].advance(1, f"epoch {len(epochs) + 1} loss {logs['loss']:.4f}")

        def on_epoch_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            epoch = len(epochs) + 1
            t0, c0 = time.perf_counter(), time.process_time()
            with float32_forward(model):  # scores compare across training precisions
                dev = evaluator.evaluate(ProgressEncoder(model, f"dev eval, epoch {epoch}: encode"), ["dev"])
            losses = [loss_ for pos, loss_ in step_losses if epoch - 1 < pos <= epoch + 1e-9]
            row = {"epoch": float(epoch), "train_loss": sum(losses) / len(losses) if losses else float("nan"), **dev}
            eval_s.append((time.perf_counter() - t0, time.process_time() - c0))
            epochs.append(row)
            log.info("epoch %d: train_loss %.4f  dev_ndcg@10 %.4f  (dev eval %.0f s)",
                     epoch, row["train_loss"], dev["dev_ndcg@10"], eval_s[-1][0])
            if on_epoch is not None:
                on_epoch(epoch, dict(dev))
            model.train()

    scratch = out_dir / ".trainer"
    args = SentenceTransformerTrainingArguments(
        output_dir=str(scratch),
        num_train_epochs=cfg.epochs,
        per_device_train_batch_size=cfg.batch_size,
        learning_rate=cfg.learning_rate,
        warmup_steps=cfg.warmup_ratio,  # < 1: a fraction of all steps (transformers' convention)
        weight_decay=cfg.weight_decay,
        batch_sampler=BatchSamplers.NO_DUPLICATES,
        seed=cfg.seed,
        data_seed=cfg.seed,
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="steps",
        logging_steps=1,
        report_to="none",
        use_cpu=device == "cpu",
        bf16=precision == "bf16",  # autocast of the forward; weights, adapter and optimizer stay float32
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    # A model card's widget is never written (only the adapter is saved); with none, the trainer samples one
    # from the data at start, behind a stray tqdm bar ("Computing widget examples") in every log.
    model.model_card_data.widget = [{"text": "lorafleet"}]
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=train_data, loss=loss, callbacks=[_EpochEval()]
    )
    trainer.remove_callback(PrinterCallback)  # our own progress lines replace its raw dicts
    log.info("training: %d pairs (%d negatives each), %d epochs, %d trainable LoRA parameters, device %s, "
             "precision %s, dropout masks %s", len(train_data), data_stats["train_negatives"], cfg.epochs, trainable,
             device, precision, "fast" if swapped else "torch")
    t_train, c_train = time.perf_counter(), time.process_time()
    try:
        trainer.train()
    finally:
        drop_autocast(model)
        for bar in bars:
            bar.close()
        shutil.rmtree(scratch, ignore_errors=True)
    # The training loop alone (the per-epoch dev evaluations taken out): what the precision changes. CPU seconds
    # (all threads) beside wall: on a shared machine they move less with other processes' load.
    train_s = time.perf_counter() - t_train - sum(w for w, _ in eval_s)
    train_cpu_s = time.process_time() - c_train - sum(c for _, c in eval_s)

    # The last dev evaluation encoded the corpus with the final weights; test reuses it.
    test: dict[str, float] = {}
    if evaluate_test:
        with torch.no_grad():
            test = evaluator.evaluate(model, ["test"], reuse_corpus=True)
    adapter_dir = save_adapter(model, out_dir / "adapter", cfg.base_model)
    metrics = {k: v for k, v in epochs[-1].items() if k.startswith("dev_")}
    metrics.update(test)
    metrics["train_loss"] = epochs[-1]["train_loss"]
    metrics.update({k: float(v) for k, v in data_stats.items()})
    metrics["trainable_params"] = float(trainable)
    metrics["train_s"] = round(train_s, 2)
    metrics["train_cpu_s"] = round(train_cpu_s, 2)
    return TrainResult(
        adapter_dir=adapter_dir, metrics=metrics, epochs=epochs, cost=meter.read(), dataset_digest=dataset.digest,
        extras={"device": device, "training_precision": precision, **({"model": model} if keep_model else {})},
    )
