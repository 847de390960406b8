"""Where lorafleet keeps its state on one machine, and the environment it reads."""

from __future__ import annotations

import os
from pathlib import Path

# MLflow phones home and starts job runners unless told not to; set before anything imports it.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")


class DataDirError(RuntimeError):
    """The dataset folder is missing or does not hold what lorafleet expects."""


def home() -> Path:
    """`LORAFLEET_HOME` (default `./.lorafleet`): NATS store, MLflow store, Optuna storage, logs."""
    path = Path(os.environ.get("LORAFLEET_HOME", ".lorafleet")).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    """`LORAFLEET_DATA_DIR`: the folder that holds `gesetze/*.md`."""
    raw = os.environ.get("LORAFLEET_DATA_DIR")
    if not raw:
        raise DataDirError(
            "LORAFLEET_DATA_DIR is not set: point it at the folder that holds gesetze/*.md "
            "(for example ../shared/data)."
        )
    path = Path(raw).expanduser().resolve()
    if not path.is_dir():
        raise DataDirError(f"LORAFLEET_DATA_DIR={raw} is not a directory.")
    return path


def logs_dir() -> Path:
    path = home() / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def mlflow_tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` if set, else a sqlite store under `LORAFLEET_HOME/mlflow`."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    folder = home() / "mlflow"
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}"


def mlflow_artifact_root() -> str:
    folder = home() / "mlflow" / "artifacts"
    folder.mkdir(parents=True, exist_ok=True)
    return folder.as_uri()
