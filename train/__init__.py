"""lorafleet.train: German statute retrieval data, LoRA training (sentence-transformers + peft), evaluation.

Heavy libraries (torch, transformers, mlflow) load inside the functions that need them, so
importing this package is cheap.
"""

from lorafleet.train.config import DataConfig, LoraSettings, TrainConfig, load_train_config
from lorafleet.train.dataset import DatasetError, RetrievalDataset, build_dataset, check_no_leakage
from lorafleet.train.evaluate import METRICS, evaluate_bm25, evaluate_model
from lorafleet.train.run import mlflow_metric_name, mlflow_metrics, run_train
from lorafleet.train.trainer import TrainResult, load_adapter_model, train_adapter

__all__ = [
    "METRICS",
    "DataConfig",
    "DatasetError",
    "LoraSettings",
    "RetrievalDataset",
    "TrainConfig",
    "TrainResult",
    "build_dataset",
    "check_no_leakage",
    "evaluate_bm25",
    "evaluate_model",
    "load_adapter_model",
    "load_train_config",
    "mlflow_metric_name",
    "mlflow_metrics",
    "run_train",
    "train_adapter",
]
