"""Where lorafleet keeps its state on one machine, and the environment it reads."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

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


# The fleet `lorafleet up` serves when given none, if present (relative: a checkout of this repository).
DEFAULT_FLEET = Path("configs/fleet.yaml")
DATA_SOURCE_FILE = "SOURCE.json"  # written by `lorafleet data fetch`: where the statutes came from


def data_cache_dir() -> Path:
    """Where `lorafleet data fetch` stores the statutes when LORAFLEET_DATA_DIR is not set."""
    return home() / "data"


def data_dir() -> Path:
    """The folder holding `gesetze/*.md`: `LORAFLEET_DATA_DIR` if set, else the cache that
    `lorafleet data fetch` fills (LORAFLEET_HOME/data); a DataDirError that says what to do otherwise."""
    raw = os.environ.get("LORAFLEET_DATA_DIR")
    if raw:
        path = Path(raw).expanduser().resolve()
        if not path.is_dir():
            raise DataDirError(f"LORAFLEET_DATA_DIR={raw} is not a directory (unset it to use the cache that "
                               "`lorafleet data fetch` fills)")
        return path
    cache = data_cache_dir()
    if (cache / "gesetze").is_dir():
        return cache
    raise DataDirError(
        f"no statutes found: run `lorafleet data fetch` (downloads the public bundestag/gesetze collection into "
        f"{cache}), or point LORAFLEET_DATA_DIR at a folder holding gesetze/*.md"
    )


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


# Tracking URIs answered by an MLflow server, which owns the artifact store: started with
# `--serve-artifacts` its default root is `mlflow-artifacts:/`, proxied over the same URL, so a worker on
# another host can download what a trainer logged. A local file root there would strand artifacts here.
SERVER_SCHEMES = ("http", "https", "databricks")


def mlflow_remote() -> bool:
    """True when MLFLOW_TRACKING_URI names an MLflow server (http(s)://…), not a store on this machine."""
    return urlsplit(mlflow_tracking_uri()).scheme.lower() in SERVER_SCHEMES


def mlflow_artifact_root(sub: str = "") -> str | None:
    """Where new experiments keep artifacts: a folder under LORAFLEET_HOME/mlflow/artifacts (plus `sub`) for a
    store on this machine; None for a tracking server, whose own (proxied) artifact root then applies."""
    if mlflow_remote():
        return None
    folder = home() / "mlflow" / "artifacts"
    folder.mkdir(parents=True, exist_ok=True)
    return f"{folder.as_uri()}/{sub}" if sub else folder.as_uri()
