"""The rerank task kind: a LoRA (with its own classification head) on a cross-encoder, judged as a pipeline.

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

import json
import logging
import random
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from lorafleet.config import ConfigError
from lorafleet.device import resolve_device
from lorafleet.metrics import prefixed
from lorafleet.tasks import EpochCallback, MetricSpec, Rival, TaskKind, TrainResult
from lorafleet.train.dropout import use_fast_dropout
from lorafleet.train.evaluate import TOP_K
from lorafleet.train.rerank_config import CE_BASE_SUFFIX, FirstStageSettings, RerankConfig
from lorafleet.train.rerank_eval import (
    FIRST,
    RerankDataset,
    first_stage_ranking,
    load_reranker,
    pipeline_metrics,
    stage_key,
)
from lorafleet.train.retrieval_kind import RELEVANCE_NOTE, evaluation_data_key

log = logging.getLogger("lorafleet.train")

BEST_FIRST = "bestfirst"  # metric prefix of the best first stage alone (MetricSpec.rivals)
HEAD_MODULE = "classifier"  # saved with every adapter: the runtime refuses an adapter without it
Group = tuple[str, str, list[str]]  # (query, positive, negatives)


def build_rerank_dataset(cfg: RerankConfig) -> RerankDataset:
    from lorafleet.train.dataset import build_dataset

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


def train_reranker(cfg: RerankConfig, dataset: RerankDataset, out_dir: Path, *, on_epoch: EpochCallback | None = None,
                   keep_model: bool = False, evaluate_test: bool = False) -> TrainResult:
    """Train the LoRA (and head) on the training groups, score the pipeline on dev after every epoch.

    `on_epoch(epoch, dev)` gets the pipeline's `dev_*`; what it raises propagates. Metrics: the last epoch's
    `dev_*`, the first stage alone `first_dev_*`, and test only with `evaluate_test` (a standalone run)."""
    from sentence_transformers.cross_encoder import CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers
    from transformers import PrinterCallback, TrainerCallback, set_seed

    from lorafleet.progress import StepProgress
    from lorafleet.train.trainer import CostMeter, save_peft_adapter

    meter = CostMeter(cfg.price_per_hour_usd)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    groups, stats = training_groups(cfg, dataset, device)
    first_dev = pipeline_metrics(None, dataset, cfg.first_stage, "dev", device=device, batch_size=cfg.eval_batch_size)
    set_seed(cfg.seed)
    model = load_reranker(cfg.base_model, device, cfg.max_pair_length)
    _add_lora(model, cfg)
    swapped = use_fast_dropout(model.model, device, cfg.dropout_masks)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    epochs: list[dict[str, float]] = []
    step_losses: list[tuple[float, float]] = []
    bars: list[StepProgress] = []

    def dev_metrics() -> dict[str, float]:
        return pipeline_metrics(model, dataset, cfg.first_stage, "dev", device=device, batch_size=cfg.eval_batch_size,
                                first=False)

    class _EpochEval(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            bars.append(StepProgress(state.max_steps, "train reranker"))

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any) -> None:
            if logs and "loss" in logs:
                step_losses.append((float(state.epoch or 0), float(logs["loss"])))
                if bars:
                    bars[-1].advance(1, f"epoch {len(epochs) + 1} loss {logs['loss']:.4f}")

        def on_epoch_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            epoch = len(epochs) + 1
            dev = dev_metrics()
            losses = [v for pos, v in step_losses if epoch - 1 < pos <= epoch + 1e-9]
            epochs.append({"epoch": float(epoch), "train_loss": sum(losses) / len(losses) if losses else float("nan"),
                           **dev})
            log.info("epoch %d: train_loss %.4f  dev_ndcg@10 %.4f (first stage %.4f)", epoch,
                     epochs[-1]["train_loss"], dev["dev_ndcg@10"], first_dev[f"{FIRST}_dev_ndcg@10"])
            if on_epoch is not None:
                on_epoch(epoch, dict(dev))
            model.model.train()

    scratch = out_dir / ".trainer"
    args = CrossEncoderTrainingArguments(
        output_dir=str(scratch), num_train_epochs=cfg.epochs, per_device_train_batch_size=cfg.batch_size,
        learning_rate=cfg.learning_rate, warmup_steps=cfg.warmup_ratio, weight_decay=cfg.weight_decay,
        batch_sampler=BatchSamplers.NO_DUPLICATES if cfg.loss == "mnrl" else BatchSamplers.BATCH_SAMPLER,
        seed=cfg.seed, data_seed=cfg.seed, save_strategy="no", eval_strategy="no", logging_strategy="steps",
        logging_steps=1, report_to="none", use_cpu=device == "cpu", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = CrossEncoderTrainer(model=model, args=args, train_dataset=_train_data(cfg, groups),
                                  loss=_loss(cfg, model), callbacks=[_EpochEval()])
    trainer.remove_callback(PrinterCallback)
    log.info("training reranker: %d queries (%d negatives each, loss %s), %d epochs, %d trainable parameters, "
             "first stage %s top %d, device %s, dropout masks %s", len(groups), cfg.data.num_negatives, cfg.loss,
             cfg.epochs, trainable, cfg.first_stage.kind, cfg.first_stage.depth, device, "fast" if swapped else "torch")
    try:
        trainer.train()
    finally:
        for bar in bars:
            bar.close()
        shutil.rmtree(scratch, ignore_errors=True)
    model.model.eval()
    adapter_dir = save_peft_adapter(model.model, out_dir / "adapter", cfg.base_model)
    metrics = {k: v for k, v in epochs[-1].items() if k.startswith("dev_")}
    metrics.update(first_dev)
    if evaluate_test:
        metrics.update(pipeline_metrics(model, dataset, cfg.first_stage, "test", device=device,
                                        batch_size=cfg.eval_batch_size))
    metrics.update({"train_loss": epochs[-1]["train_loss"], "trainable_params": float(trainable), **stats})
    return TrainResult(adapter_dir=adapter_dir, metrics=metrics, epochs=epochs, cost=meter.read(),
                       dataset_digest=dataset.digest,
                       extras={"device": device, "groups": groups, **({"model": model} if keep_model else {})})


def load_adapter_reranker(cfg: RerankConfig, adapter_dir: Path, device: str = "cpu") -> Any:
    """The base cross-encoder (from `cfg.base_model`, never the path inside the adapter) with the adapter active."""
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter_dir} is not a peft adapter directory (no adapter_config.json)")
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


class RerankKind(TaskKind):
    """(query, document) → relevance, judged by the reranked first stage's nDCG@10."""

    name: ClassVar[str] = "rerank"
    capability: ClassVar[str] = "score"
    bundle_kind: ClassVar[str] = "cross-encoder"
    default_runtime: ClassVar[str] = "cross-encoder"
    metrics: ClassVar[MetricSpec] = MetricSpec(
        objective="dev_ndcg@10", direction="maximize", baseline=FIRST, baseline_label="first stage alone",
        label="nDCG@10 (reranked)", table=("test_ndcg@10", "base_test_ndcg@10", "first_test_ndcg@10", "dev_ndcg@10"),
        report=("ndcg@10", "mrr@10", "recall@1", "recall@10", "recall@depth"),
        # Against a BERT with a fresh head the base reranker is a straw man: the pipeline must beat the better of
        # it and its own first stage alone (`best_`, from `baselines` of the pipeline's own config), and the best
        # first stage alone of those its research space holds (`bestfirst_`, from `rivals`), in research's
        # verdict and at promotion.
        gate="best", gate_label="the better of its own first stage alone and the base reranker on it",
        rivals=(Rival(BEST_FIRST, "the best first stage alone (of those the search space holds)",
                      "best first stage alone"),),
        # Scores the reranker moves. Not recall@depth (the first stage's candidates: a deeper trial wins by depth
        # alone), nor recall@10/recall@100 (a reranker of the top k ≤ 10, or of any k ≤ 100, cannot change them).
        objectives=(("dev_mrr@10", "maximize"), ("dev_recall@1", "maximize")),
        notes=(RELEVANCE_NOTE,),
    )
    config_model: ClassVar[type[RerankConfig]] = RerankConfig

    def dataset_key(self, cfg: RerankConfig) -> str:
        return super().dataset_key(cfg) + f"|{cfg.max_seq_length}"  # the corpus is chunked to it

    def baseline_key(self, cfg: RerankConfig) -> str:
        """The baselines are the config's own pipeline's: its evaluation data, the first stage and depth, and the
        cross-encoder base with its pair length."""
        s = cfg.first_stage
        return json.dumps([evaluation_data_key(cfg), list(stage_key(s)), s.depth, cfg.max_pair_length],
                          sort_keys=True, default=str)

    def rivals(self, cfg: RerankConfig, dataset: RerankDataset, variants: Sequence[RerankConfig]
               ) -> dict[str, float]:
        """`bestfirst_`: the best first stage alone among `cfg`'s and those of `variants` (the research space's), on
        `cfg`'s data."""
        return best_first_stage(cfg, dataset, [cfg.first_stage, *(v.first_stage for v in variants)])

    def base_name(self, cfg: RerankConfig) -> str:
        """The cross-encoder base of the fleet (`served_base`, else `<base name>-ce`): the embedder of the same
        checkpoint is another base, and promotion must find this one."""
        from lorafleet.models import base_name_for

        return cfg.served_base or f"{base_name_for(cfg.base_model)}{CE_BASE_SUFFIX}"

    def build_dataset(self, cfg: RerankConfig) -> RerankDataset:
        return build_rerank_dataset(cfg)

    def baselines(self, cfg: RerankConfig, dataset: RerankDataset) -> dict[str, float]:
        return rerank_baselines(cfg, dataset)

    def train(self, cfg: RerankConfig, dataset: RerankDataset, out_dir: Path, *,
              on_epoch: EpochCallback | None = None) -> TrainResult:
        return train_reranker(cfg, dataset, out_dir, on_epoch=on_epoch)

    def evaluate(self, cfg: RerankConfig, dataset: RerankDataset, adapter_dir: Path, split: str) -> dict[str, float]:
        """The pipeline's `{split}_*` and, beside it, its own first stage alone (`first_{split}_*`): a winner whose
        first stage differs from the `train:` section's is compared with the right one."""
        device = resolve_device(cfg.device)
        model = load_adapter_reranker(cfg, Path(adapter_dir), device)
        return pipeline_metrics(model, dataset, cfg.first_stage, split, device=device, batch_size=cfg.eval_batch_size)

    def run(self, cfg: RerankConfig, out_dir: Path | None = None, *, log_mlflow: bool = True,
            run_name: str | None = None) -> TrainResult:
        return run_rerank_train(cfg, out_dir, log_mlflow=log_mlflow, run_name=run_name)

    def bundle_details(self, cfg: RerankConfig) -> dict[str, Any]:
        """The pair length the runtime truncates to, and the whole pipeline the adapter was trained and scored in."""
        s = cfg.first_stage
        return {"max_seq_length": cfg.max_pair_length,
                "pipeline": {"first_stage": s.kind, "embedder": s.embedder if s.kind != "bm25" else None,
                             "rrf_k": s.rrf_k if s.kind == "hybrid" else None, "depth": s.depth,
                             "chunk_tokens": cfg.max_seq_length, "section_score": "max over chunks",
                             "loss": cfg.loss}}


def run_rerank_train(cfg: RerankConfig, out_dir: Path | None = None, *, log_mlflow: bool = True,
                     run_name: str | None = None) -> TrainResult:
    """`lorafleet train` for task `rerank`: dataset, baselines, training, test, metrics.json + report.md, MLflow."""
    import yaml

    from lorafleet.train import tracking
    from lorafleet.train.run import default_out_dir
    from lorafleet.train.trainer import CostMeter

    meter = CostMeter(cfg.price_per_hour_usd)
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    dataset = build_rerank_dataset(cfg)
    (out / "train_config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False,
                                                          allow_unicode=True))
    with tracking.train_run(run_name, enabled=log_mlflow) as run:
        if run is not None:
            tracking.log_config(cfg, RerankKind.name)
            tracking.log_dataset(dataset.to_frame(), tracking.dataset_name(RerankKind.name, dataset), dataset.digest,
                                 dataset.summary())
        base = rerank_baselines(cfg, dataset)
        if run is not None:
            tracking.log_headline(base, RerankKind.name)

        def on_epoch(epoch: int, dev: dict[str, float]) -> None:
            if run is not None:
                tracking.log_epoch(epoch, dev, RerankKind.name)

        result = train_reranker(cfg, dataset, out, on_epoch=on_epoch, evaluate_test=True)
        result.extras.pop("groups", None)
        result.metrics.update(base)
        result.extras["train_cost"] = result.cost
        result.cost = meter.read()
        result.report_path = _write_report(out / "report.md", cfg, result)
        (out / "metrics.json").write_text(json.dumps({
            "metrics": result.metrics, "epochs": result.epochs, "cost": result.cost, "dataset_digest": dataset.digest,
            "dataset": dataset.summary(), "pipeline": RerankKind().bundle_details(cfg)}, indent=2, sort_keys=True))
        if run is not None:
            tracking.log_result(run, result, out, live_epochs=True, task=RerankKind.name)
        return result


def _write_report(path: Path, cfg: RerankConfig, result: TrainResult) -> Path:
    m, s = result.metrics, cfg.first_stage
    lines = ["# Reranker training report", "",
             f"- cross-encoder base `{cfg.base_model}`, pairs of up to {cfg.max_pair_length} tokens; first stage "
             f"{s.kind} (top {s.depth} reranked); loss {cfg.loss}; LoRA r={cfg.lora.r} alpha={cfg.lora.alpha}",
             f"- dataset digest `{result.dataset_digest}`", ""]
    for split in ("dev", "test"):
        lines += [f"## {split}", "", "| metric | first stage alone | base reranker | LoRA reranker |",
                  "|---|---|---|---|"]
        for name in RerankKind.metrics.report:
            key = f"{split}_{name}"
            lines.append(f"| {name} | {m.get(f'{FIRST}_{key}', float('nan')):.4f} | "
                         f"{m.get(f'base_{key}', float('nan')):.4f} | {m.get(key, float('nan')):.4f} |")
        lines.append("")
    c = result.cost
    lines += ["## Cost", "", f"wall {c['wall_s']:.0f} s, CPU {c['cpu_s']:.0f} s, ≈ ${c['usd']:.4f}", ""]
    path.write_text("\n".join(lines))
    return path
