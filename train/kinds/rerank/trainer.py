"""The rerank kind's parts of training: a LoRA (with its own classification head) on a cross-encoder.

Registered as `rerank` in the entry-point group `lorafleet.tasks`; served by the `cross-encoder`
runtime (capability `score`). Data are the retrieval kind's (statutes, or your own `pairs`/`corpus`
tables), built by the same code, so digests and leakage checks are shared.

Training: each training query, its positive (the first chunk of its relevant section) and
`data.num_negatives` hard negatives mined from the *first stage's* ranking (the candidates the
reranker will see at serving time), taken only from sections that are no dev or test answer.

Loss (default `mnrl`): a softmax over the positive, the mined negatives and `in_batch_negatives` other
queries' documents (0: none). Every query has one relevant section and the reranker's only job is to put it
above the first stage's other candidates: that is exactly a listwise softmax (an MRR/nDCG surrogate),
where pointwise BCE (`bce`) spends capacity calibrating absolute scores and LambdaLoss (`lambda`)
needs graded lists it has nothing to grade. Both stay selectable for research.

Adapters are peft LoRAs of task type SEQ_CLS with `modules_to_save=["classifier"]`: the trained head
is saved with the adapter, which is what the runtime requires. Heavy imports happen inside functions.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lorafleet.core.config import ConfigError
from lorafleet.core.metrics import prefixed
from lorafleet.core.tasks import EpochCallback, TrainResult
from lorafleet.models.device import resolve_device
from lorafleet.train.dropout import use_fast_dropout
from lorafleet.train.kinds.rerank.config import FirstStageSettings, RerankConfig
from lorafleet.train.kinds.rerank.evaluate import (
    FIRST,
    RerankDataset,
    first_stage_ranking,
    load_reranker,
    pipeline_metrics,
    stage_key,
)
from lorafleet.train.kinds.retrieval.evaluate import TOP_K
from lorafleet.train.loop import KindTrainer, check_adapter_dir, save_peft_adapter, train_with, trainable_params

log = logging.getLogger("lorafleet.train")

BEST_FIRST = "bestfirst"  # metric prefix of the best first stage alone (MetricSpec.rivals)
HEAD_MODULE = "classifier"  # saved with every adapter: the runtime refuses an adapter without it
Group = tuple[str, str, list[str]]  # (query, positive, negatives)


def build_rerank_dataset(cfg: RerankConfig) -> RerankDataset:
    from lorafleet.train.kinds.retrieval.dataset import build_dataset

    return RerankDataset(build_dataset(cfg.retrieval_config()))


def training_groups(cfg: RerankConfig, dataset: RerankDataset, device: str = "cpu"
                    ) -> tuple[list[Group], dict[str, float]]:
    """(query, positive, negatives) per training query, and counts (pairs, negatives each, queries filled at random).

    Negatives are the first chunks of the first stage's best-ranked non-relevant sections within its top
    `negative_range_max` (None: 100), among sections that answer no dev or test query and whose text differs from
    the positive's; a query with too few (or `hard_negatives: false`, where the data's own negatives come first)
    is filled with seeded random training documents."""
    data = dataset.retrieval
    n = cfg.data.num_negatives
    held_out = {sid for sid, split in data.split_of_section.items() if split in ("dev", "test")}
    allowed = [sid for sid in data.sections if sid not in held_out and f"{sid}#0" in data.corpus]
    pool = sorted({data.first_chunk(sid).text for sid in allowed})
    if len(pool) <= n + 1:
        raise ConfigError(f"only {len(pool)} training documents: too few for {n} negatives per query")
    ranking = (first_stage_ranking(dataset, cfg.first_stage, "train", device, cfg.eval_batch_size)
               if cfg.data.hard_negatives else {})
    window = cfg.data.negative_range_max or TOP_K
    allowed_set = set(allowed)
    rng = random.Random(cfg.seed)
    groups: list[Group] = []
    filled = 0
    for qid, (query, positive) in zip(data.queries["train"], data.train_pairs(), strict=True):
        relevant = set(data.qrels["train"][qid])
        if cfg.data.hard_negatives:
            negs = [data.first_chunk(sid).text for sid, _ in ranking.get(qid, [])[:window]
                    if sid in allowed_set and sid not in relevant]
        else:
            negs = list(data.given_negatives.get(qid, []))
        negs = list(dict.fromkeys(t for t in negs if t != positive))[:n]
        if len(negs) < n:
            filled += 1
            negs += rng.sample([t for t in pool if t != positive and t not in negs], n - len(negs))
        groups.append((query, positive, negs))
    return groups, {"train_pairs": float(len(groups)), "train_negatives": float(n),
                    "train_random_negative_queries": float(filled)}


def _train_data(cfg: RerankConfig, groups: list[Group]) -> Any:
    """The loss's input format: mnrl (query, positive, negative_1…n); bce labelled pairs; lambda labelled lists."""
    from datasets import Dataset

    if cfg.loss == "mnrl":
        cols: dict[str, list[str]] = {"query": [g[0] for g in groups], "positive": [g[1] for g in groups]}
        for i in range(cfg.data.num_negatives):
            cols[f"negative_{i + 1}"] = [g[2][i] for g in groups]
        return Dataset.from_dict(cols)
    if cfg.loss == "bce":
        rows = [(q, d, float(d == p)) for q, p, negs in groups for d in [p, *negs]]
        return Dataset.from_dict({"query": [r[0] for r in rows], "document": [r[1] for r in rows],
                                  "label": [r[2] for r in rows]})
    return Dataset.from_dict({"query": [g[0] for g in groups], "docs": [[g[1], *g[2]] for g in groups],
                              "labels": [[1.0] + [0.0] * len(g[2]) for g in groups]})


def _loss(cfg: RerankConfig, model: Any) -> Any:
    import torch
    from sentence_transformers.cross_encoder import losses

    if cfg.loss == "mnrl":
        mnrl = losses.MultipleNegativesRankingLoss if cfg.in_batch_negatives else _mined_negatives_only_mnrl()
        return mnrl(model, num_negatives=cfg.in_batch_negatives, scale=cfg.scale)
    if cfg.loss == "bce":  # one positive per num_negatives negatives: weigh them alike
        return losses.BinaryCrossEntropyLoss(model, pos_weight=torch.tensor(float(cfg.data.num_negatives)))
    return losses.LambdaLoss(model)


def _mined_negatives_only_mnrl() -> type:
    """mnrl over the positive and the mined negatives alone (`in_batch_negatives: 0`): sentence-transformers reads
    num_negatives=None as every other document of the batch and cannot sample 0, so "none" skips that step."""
    from sentence_transformers.cross_encoder.losses import MultipleNegativesRankingLoss

    class MinedNegativesOnlyMNRL(MultipleNegativesRankingLoss):
        def get_in_batch_negatives(self, anchors: list[str], candidates: list[list[str]]) -> Iterator[list[str]]:
            return iter(())

    return MinedNegativesOnlyMNRL


def listwise_loss(model: Any, groups: list[Group], batch_size: int = 64) -> float:
    """Mean softmax cross-entropy of the positive against its negatives on the raw logits: a deterministic
    yardstick (eval mode, fixed groups) to compare a model before and after training, whatever the loss."""
    import torch

    pairs = [[q, d] for q, p, negs in groups for d in [p, *negs]]
    logits = model.predict(pairs, batch_size=batch_size, activation_fn=torch.nn.Identity(), convert_to_tensor=True,
                           show_progress_bar=False).float().reshape(len(groups), -1)
    return float(torch.nn.functional.cross_entropy(logits, torch.zeros(len(groups), dtype=torch.long)))


def _add_lora(model: Any, cfg: RerankConfig) -> None:
    from peft import LoraConfig, TaskType

    lora = LoraConfig(task_type=TaskType.SEQ_CLS, r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                      lora_dropout=cfg.lora.dropout, target_modules=list(cfg.lora.target_modules),
                      modules_to_save=[HEAD_MODULE])
    try:
        model.add_adapter(lora)
    except ValueError as exc:
        raise ConfigError(f"lora.target_modules={cfg.lora.target_modules} do not fit {cfg.base_model}: {exc}") from exc




class RerankTrainer(KindTrainer):
    """The rerank kind's parts of the loop: groups mined from the first stage, the cross-encoder with its LoRA and
    head, the chosen loss, and the whole pipeline (first stage, then the reranker) scored on dev and test."""

    progress_label = "train reranker"
    log_keys = ("dev_ndcg@10",)

    def __init__(self, cfg: RerankConfig, dataset: RerankDataset) -> None:
        super().__init__(cfg, dataset)
        self.device = "cpu"
        self.groups: list[Group] = []
        self.group_stats: dict[str, float] = {}
        self.first_dev: dict[str, float] = {}

    def prepare(self, device: str) -> None:
        cfg = self.cfg
        self.device = device
        self.groups, self.group_stats = training_groups(cfg, self.dataset, device)
        self.first_dev = pipeline_metrics(None, self.dataset, cfg.first_stage, "dev", device=device,
                                          batch_size=cfg.eval_batch_size)
        log.info("first stage alone: dev_ndcg@10 %.4f", self.first_dev[f"{FIRST}_dev_ndcg@10"])

    def trainer(self, device: str, out_dir: Path, callbacks: list[Any]) -> Any:
        from sentence_transformers.cross_encoder import CrossEncoderTrainer, CrossEncoderTrainingArguments
        from sentence_transformers.sentence_transformer.training_args import BatchSamplers

        cfg = self.cfg
        model = load_reranker(cfg.base_model, device, cfg.max_pair_length)
        _add_lora(model, cfg)
        swapped = use_fast_dropout(model.model, device, cfg.dropout_masks)
        args = CrossEncoderTrainingArguments(
            output_dir=str(out_dir / ".trainer"), num_train_epochs=cfg.epochs,
            per_device_train_batch_size=cfg.batch_size, learning_rate=cfg.learning_rate,
            warmup_steps=cfg.warmup_ratio, weight_decay=cfg.weight_decay,
            batch_sampler=BatchSamplers.NO_DUPLICATES if cfg.loss == "mnrl" else BatchSamplers.BATCH_SAMPLER,
            seed=cfg.seed, data_seed=cfg.seed, save_strategy="no", eval_strategy="no", logging_strategy="steps",
            logging_steps=1, report_to="none", use_cpu=device == "cpu", disable_tqdm=True, dataloader_num_workers=0,
        )
        log.info("training reranker: %d queries (%d negatives each, loss %s), %d epochs, %d trainable parameters, "
                 "first stage %s top %d, device %s, dropout masks %s", len(self.groups), cfg.data.num_negatives,
                 cfg.loss, cfg.epochs, trainable_params(model), cfg.first_stage.kind, cfg.first_stage.depth, device,
                 "fast" if swapped else "torch")
        return CrossEncoderTrainer(model=model, args=args, train_dataset=_train_data(cfg, self.groups),
                                   loss=_loss(cfg, model), callbacks=callbacks)

    def evaluate(self, model: Any, split: str, epoch: int) -> dict[str, float]:
        # Each epoch scores the pipeline alone; the final look adds its first stage alone (`first_test_*`).
        return pipeline_metrics(model, self.dataset, self.cfg.first_stage, split, device=self.device,
                                batch_size=self.cfg.eval_batch_size, first=split != "dev")

    def save(self, model: Any, out_dir: Path) -> Path:
        model.model.eval()
        return save_peft_adapter(model.model, out_dir / "adapter", self.cfg.base_model)

    def stats(self, trainer: Any, timing: dict[str, float]) -> dict[str, float]:
        return {**self.first_dev, **self.group_stats}

    def extras(self) -> dict[str, Any]:
        return {"groups": self.groups}


def train_reranker(cfg: RerankConfig, dataset: RerankDataset, out_dir: Path, *, on_epoch: EpochCallback | None = None,
                   keep_model: bool = False, evaluate_test: bool = False) -> TrainResult:
    """Train the LoRA (and head) on the training groups, score the pipeline on dev after every epoch.

    `on_epoch(epoch, dev)` gets the pipeline's `dev_*`; what it raises propagates. Metrics: the last epoch's
    `dev_*`, the first stage alone `first_dev_*`, and test only with `evaluate_test` (a standalone run)."""
    return train_with(RerankTrainer(cfg, dataset), out_dir, on_epoch=on_epoch,
                      keep_model=keep_model, evaluate_test=evaluate_test)


def load_adapter_reranker(cfg: RerankConfig, adapter_dir: Path, device: str = "cpu") -> Any:
    """The base cross-encoder (from `cfg.base_model`, never the path inside the adapter) with the adapter active."""
    adapter_dir = check_adapter_dir(adapter_dir)
    model = load_reranker(cfg.base_model, device, cfg.max_pair_length)
    model.load_adapter(str(adapter_dir))
    model.model.eval()
    return model


def rerank_baselines(cfg: RerankConfig, dataset: RerankDataset) -> dict[str, float]:
    """On dev and test, for `cfg`'s own pipeline (its first stage and depth): the base cross-encoder reranking that
    first stage (`base_`), the first stage alone (`first_`), per metric the better of the two (`best_`: what the
    gate compares against), and the best first stage alone (`bestfirst_`; here only its own, research widens it to
    the first stages of its space through `RerankKind.rivals`)."""
    device = resolve_device(cfg.device)
    base = load_reranker(cfg.base_model, device, cfg.max_pair_length)
    out: dict[str, float] = {}
    for split in ("dev", "test"):
        m = pipeline_metrics(base, dataset, cfg.first_stage, split, device=device, batch_size=cfg.eval_batch_size)
        out.update({k: v for k, v in m.items() if k.startswith(f"{FIRST}_")})
        out.update(prefixed({k: v for k, v in m.items() if not k.startswith(f"{FIRST}_")}, "base"))
    for key in [k.removeprefix("base_") for k in out if k.startswith("base_")]:
        if f"{FIRST}_{key}" in out:  # what the gate compares against (MetricSpec.gate)
            out[f"best_{key}"] = max(out[f"base_{key}"], out[f"{FIRST}_{key}"])
    out.update(best_first_stage(cfg, dataset, [cfg.first_stage]))
    return out


def best_first_stage(cfg: RerankConfig, dataset: RerankDataset, stages: Sequence[FirstStageSettings]
                     ) -> dict[str, float]:
    """Per metric on dev and test, the best of `stages` alone (no reranker) on `cfg`'s data (`bestfirst_`): what a
    pipeline must beat beside its own first stage, since serving that first stage alone is always an option.
    `recall@depth` is left out: it depends on the depth, not on the stage's ranking alone."""
    device = resolve_device(cfg.device)
    distinct = {stage_key(s): s for s in stages}
    out: dict[str, float] = {}
    for s in distinct.values():
        for split in ("dev", "test"):
            m = pipeline_metrics(None, dataset, s, split, device=device, batch_size=cfg.eval_batch_size)
            for key, value in m.items():
                name = key.removeprefix(f"{FIRST}_")
                if not name.endswith("recall@depth"):
                    out[f"{BEST_FIRST}_{name}"] = max(value, out.get(f"{BEST_FIRST}_{name}", value))
    return out

