"""The retrieval kind's parts of training: a peft LoRA on a sentence-transformers model, MNRL, mined negatives."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from lorafleet.core.config import ConfigError
from lorafleet.core.model_source import resolve_model_source
from lorafleet.core.progress import StepProgress, quiet_library_bars
from lorafleet.core.tasks import EpochCallback, TrainResult
from lorafleet.train.dropout import use_fast_dropout
from lorafleet.train.kinds.retrieval.config import TrainConfig
from lorafleet.train.kinds.retrieval.dataset import RetrievalDataset
from lorafleet.train.kinds.retrieval.evaluate import DenseEvaluator
from lorafleet.train.loop import KindTrainer, check_adapter_dir, save_peft_adapter, train_with, trainable_params
from lorafleet.train.precision import resolve_training_precision

log = logging.getLogger("lorafleet.train")


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
    adapter_dir = check_adapter_dir(adapter_dir)
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


class RetrievalTrainer(KindTrainer):
    """The retrieval kind's parts of the loop: MNRL (or cached MNRL) on (query, positive, negatives) rows, a LoRA of
    task type FEATURE_EXTRACTION, dense dev evaluation (test reuses the last dev pass's corpus embeddings)."""

    log_keys = ("dev_ndcg@10",)

    def __init__(self, cfg: TrainConfig, dataset: RetrievalDataset) -> None:
        super().__init__(cfg, dataset)
        self.evaluator = DenseEvaluator(dataset, cfg.eval_batch_size)
        self.precision = "fp32"
        self.data_stats: dict[str, float] = {}

    def prepare(self, device: str) -> None:
        self.precision = resolve_training_precision(self.cfg.precision, device)  # before any work: fails now

    def trainer(self, device: str, out_dir: Path, callbacks: list[Any]) -> Any:
        from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
        from sentence_transformers.sentence_transformer.losses import (
            CachedMultipleNegativesRankingLoss,
            MultipleNegativesRankingLoss,
        )
        from sentence_transformers.sentence_transformer.training_args import BatchSamplers

        cfg = self.cfg
        model = load_base_model(cfg.base_model, device, cfg.max_seq_length)
        train_data, self.data_stats = _train_dataset(cfg, self.dataset, model)
        _add_lora(model, cfg)
        swapped = use_fast_dropout(model, device, cfg.dropout_masks)
        if cfg.loss == "cached_mnrl":
            loss = CachedMultipleNegativesRankingLoss(model, scale=cfg.scale, mini_batch_size=cfg.mini_batch_size)
        else:
            loss = MultipleNegativesRankingLoss(model, scale=cfg.scale)
        args = SentenceTransformerTrainingArguments(
            output_dir=str(out_dir / ".trainer"), num_train_epochs=cfg.epochs,
            per_device_train_batch_size=cfg.batch_size, learning_rate=cfg.learning_rate,
            warmup_steps=cfg.warmup_ratio,  # < 1: a fraction of all steps (transformers' convention)
            weight_decay=cfg.weight_decay, batch_sampler=BatchSamplers.NO_DUPLICATES, seed=cfg.seed,
            data_seed=cfg.seed, save_strategy="no", eval_strategy="no", logging_strategy="steps", logging_steps=1,
            report_to="none", use_cpu=device == "cpu",
            bf16=self.precision == "bf16",  # autocast of the forward; weights, adapter and optimizer stay float32
            disable_tqdm=True, dataloader_num_workers=0,
        )
        # A model card's widget is never written (only the adapter is saved); with none, the trainer samples one
        # from the data at start, behind a stray tqdm bar ("Computing widget examples") in every log.
        model.model_card_data.widget = [{"text": "lorafleet"}]
        log.info("training: %d pairs (%d negatives each), %d epochs, %d trainable LoRA parameters, device %s, "
                 "precision %s, dropout masks %s", len(train_data), self.data_stats["train_negatives"], cfg.epochs,
                 trainable_params(model), device, self.precision, "fast" if swapped else "torch")
        return SentenceTransformerTrainer(model=model, args=args, train_dataset=train_data, loss=loss,
                                          callbacks=callbacks)

    def evaluate(self, model: Any, split: str, epoch: int) -> dict[str, float]:
        if split == "dev":
            return self.evaluator.evaluate(ProgressEncoder(model, f"dev eval, epoch {epoch}: encode"), ["dev"])
        import torch

        with torch.no_grad():  # the last dev evaluation encoded the corpus with the final weights
            return self.evaluator.evaluate(model, [split], reuse_corpus=True)

    def save(self, model: Any, out_dir: Path) -> Path:
        return save_adapter(model, out_dir / "adapter", self.cfg.base_model)

    def stats(self, trainer: Any, timing: dict[str, float]) -> dict[str, float]:
        return {k: float(v) for k, v in self.data_stats.items()}

    def extras(self) -> dict[str, Any]:
        return {"training_precision": self.precision}


def train_adapter(cfg: TrainConfig, dataset: RetrievalDataset, out_dir: Path, *, on_epoch: EpochCallback | None = None,
                  keep_model: bool = False, evaluate_test: bool = False) -> TrainResult:
    """A LoRA on `dataset`'s training queries, dev scored after each epoch; the adapter in `out_dir/adapter`
    (the rest as `train_with` says). `keep_model` puts the in-memory model into `result.extras["model"]`."""
    return train_with(RetrievalTrainer(cfg, dataset), out_dir, on_epoch=on_epoch, keep_model=keep_model,
                      evaluate_test=evaluate_test)
