"""lorafleet.train: datasets, LoRA trainers and evaluation, behind the task kinds that research uses.

The retrieval kind (`RetrievalKind`, registered as task kind `retrieval`): German statutes parsed
into sections, queries (headings, citations) split by section with a leakage check and a digest,
a LoRA on a sentence-transformers model (peft, MNRL loss, mined hard negatives), evaluated with
nDCG@10, MRR@10, recall@k and MAP@100 against the base model and BM25. Heavy libraries (torch,
transformers, mlflow) load inside the functions that need them, so importing this package is cheap.

Public API:
    RetrievalKind                                  (the task-kind strategy; lorafleet.tasks)
    TrainConfig, DataConfig, LoraSettings, load_train_config
    build_dataset(cfg) -> RetrievalDataset, check_no_leakage, DatasetError
    train_adapter(cfg, dataset, out_dir, on_epoch=…) -> TrainResult, load_adapter_model(base, adapter_dir)
    evaluate_model(model, dataset, split), evaluate_bm25(dataset, split), METRICS
    run_train(cfg, out_dir=None) -> TrainResult    (what `lorafleet train` runs for retrieval)
"""

from __future__ import annotations

from typing import Any

_CONFIG = {"DataConfig", "LoraSettings", "TrainConfig", "load_train_config"}
_DATASET = {"DatasetError", "RetrievalDataset", "build_dataset", "check_no_leakage"}
_EVALUATE = {"METRICS", "evaluate_bm25", "evaluate_model"}
_TRAINER = {"load_adapter_model", "train_adapter"}

__all__ = sorted(_CONFIG | _DATASET | _EVALUATE | _TRAINER | {"RetrievalKind", "run_train"})


def __getattr__(name: str) -> Any:
    if name in _CONFIG:
        from lorafleet.train import config

        return getattr(config, name)
    if name in _DATASET:
        from lorafleet.train import dataset

        return getattr(dataset, name)
    if name in _EVALUATE:
        from lorafleet.train import evaluate

        return getattr(evaluate, name)
    if name in _TRAINER:
        from lorafleet.train import trainer

        return getattr(trainer, name)
    if name == "RetrievalKind":
        from lorafleet.train.retrieval_kind import RetrievalKind

        return RetrievalKind
    if name == "run_train":
        from lorafleet.train.run import run_train

        return run_train
    raise AttributeError(name)
