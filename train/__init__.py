"""lorafleet.train: the one training loop and the task kinds that research trains through.

The loop (`loop`: `KindTrainer`, `train_with`) owns what every kind does alike: seeds, the trainer's callback,
progress, per-epoch dev evaluation, the one look at test, costs; the standalone run (`run`: `KindRun`,
`run_kind`) adds baselines, report, metrics.json and MLflow (`tracking`). Shared pieces: training precision
(`precision`), fast dropout (`dropout`), chunking (`chunks`), statutes and tables (`statutes`,
`statute_source`, `tables`). Each kind lives in its own room under `kinds/` (retrieval, generation, rerank)
and is registered as a task kind (entry-point group `lorafleet.tasks`). This package may import lorafleet's
ground floor, never another stage. Heavy libraries (torch, transformers, mlflow) load inside the functions
that need them, so importing this package is cheap.

Public API (the retrieval kind, what `lorafleet train` runs by default):
    RetrievalKind                                  (the task-kind strategy; lorafleet.core.tasks)
    TrainConfig, DataConfig, LoraSettings, load_train_config
    build_dataset(cfg) -> RetrievalDataset, check_no_leakage, DatasetError
    train_adapter(cfg, dataset, out_dir, on_epoch=…) -> TrainResult, load_adapter_model(base, adapter_dir)
    evaluate_model(model, dataset, split), evaluate_bm25(dataset, split), METRICS
    run_train(cfg, out_dir=None) -> TrainResult
"""

from __future__ import annotations

import importlib
from typing import Any

_RETRIEVAL = "lorafleet.train.kinds.retrieval."
# Each public name and the module it lives in; loaded on first use.
_HOME = {
    **dict.fromkeys(("DataConfig", "LoraSettings", "TrainConfig", "load_train_config"), _RETRIEVAL + "config"),
    **dict.fromkeys(("RetrievalDataset", "build_dataset", "check_no_leakage"), _RETRIEVAL + "dataset"),
    "DatasetError": "lorafleet.train.chunks",
    **dict.fromkeys(("METRICS", "evaluate_bm25", "evaluate_model"), _RETRIEVAL + "evaluate"),
    **dict.fromkeys(("load_adapter_model", "train_adapter"), _RETRIEVAL + "trainer"),
    "RetrievalKind": _RETRIEVAL + "kind",
    "run_train": _RETRIEVAL + "run",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(name)
    return getattr(importlib.import_module(_HOME[name]), name)
