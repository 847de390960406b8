"""The retrieval task kind: a LoRA on a sentence-transformers model, judged by nDCG@10 against the base and BM25.

Registered as `retrieval` in the entry-point group `lorafleet.tasks`. Heavy imports (torch,
sentence-transformers, bm25s) happen inside the methods, so loading the kind is cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lorafleet.core.tasks import MetricSpec
from lorafleet.models.device import resolve_device
from lorafleet.train.kinds.retrieval.config import TrainConfig
from lorafleet.train.kinds.retrieval.dataset import RetrievalDataset
from lorafleet.train.run import KindRun, LoopKind

# Said in every research report of the kinds that rank sections (retrieval, rerank).
RELEVANCE_NOTE = ("Relevance is binary: each query has its relevant section(s) at grade 1 and every other section at "
                  "0, so nDCG@10 here rewards ranking a relevant section high; it is not MTEB's nDCG over graded "
                  "judgements, and the numbers are not comparable with graded benchmarks.")
# Data fields that shape only the training pairs (negatives), never dev, test or the corpus: no baseline depends
# on them, so research does not compute the baselines again for a trial that changes only these.
TRAINING_ONLY_DATA = ("hard_negatives", "num_negatives", "negative_margin", "negative_range_max")


def evaluation_data_key(cfg: Any) -> str:
    """`dataset_key` without TRAINING_ONLY_DATA: configs with the same key are scored on the same data."""
    data = cfg.data.model_dump(mode="json")
    for name in TRAINING_ONLY_DATA:
        data.pop(name, None)
    return json.dumps([data, cfg.base_model, cfg.max_seq_length], sort_keys=True, default=str)


class RetrievalKind(LoopKind):
    """Query → statute section retrieval (or any corpus with queries and relevance judgements)."""

    name = "retrieval"
    capability = "embed"
    bundle_kind = "sentence-transformers"
    metrics = MetricSpec(
        objective="dev_ndcg@10", direction="maximize", baseline="bm25", baseline_label="BM25", label="nDCG@10",
        table=("test_ndcg@10", "base_test_ndcg@10", "dev_ndcg@10"),
        report=("ndcg@10", "mrr@10", "recall@1", "recall@10", "recall@100", "map@100"),
        objectives=tuple((f"dev_{m}", "maximize") for m in ("mrr@10", "recall@1", "recall@10", "recall@100",
                                                             "map@100")),
        notes=(RELEVANCE_NOTE,),
    )
    config_model = TrainConfig

    def dataset_key(self, cfg: TrainConfig) -> str:
        # The corpus is chunked to the model's length, so the chunk length shapes the data too.
        return super().dataset_key(cfg) + f"|{cfg.max_seq_length}"

    def baseline_key(self, cfg: TrainConfig) -> str:
        return evaluation_data_key(cfg)  # the base model and BM25 are scored on dev and test only

    def kind_run(self, cfg: TrainConfig) -> KindRun:
        from lorafleet.train.kinds.retrieval.run import RetrievalRun

        return RetrievalRun(cfg)

    def evaluate(self, cfg: TrainConfig, dataset: RetrievalDataset, adapter_dir: Path, split: str
                 ) -> dict[str, float]:
        from lorafleet.train.kinds.retrieval.evaluate import evaluate_model
        from lorafleet.train.kinds.retrieval.trainer import load_adapter_model

        model = load_adapter_model(cfg.base_model, Path(adapter_dir), resolve_device(cfg.device), cfg.max_seq_length)
        return evaluate_model(model, dataset, split, cfg.eval_batch_size)

    def bundle_details(self, cfg: TrainConfig) -> dict[str, Any]:
        # Pooling and normalisation are read from the base folder by the registry (bundle kind
        # sentence-transformers); the chunk length is a training choice only the config knows. The training
        # precision is what `precision` resolves to here, the machine that trained the winner.
        from lorafleet.train.precision import resolve_training_precision

        return {"max_seq_length": cfg.max_seq_length,
                "training_precision": resolve_training_precision(cfg.precision, resolve_device(cfg.device))}
