"""lorafleet.research: the auto-research loop (Optuna study over LoRA trainings, tracked in MLflow).

    lorafleet research run configs/german-legal.yaml [--trials N] [--budget-minutes M] [--study NAME]
    lorafleet research resume NAME

Python: `run_research(load_config(path), ...) -> ResearchResult`; `result.candidate` tells the ship
step (tune + register) whether `result.winner_adapter_dir` may go on.

State: the Optuna study (RDB storage, sqlite at LORAFLEET_HOME/optuna/optuna.db by default) holds the
trials, the config it was started with, the search-space fingerprint, the baseline and the MLflow
parent run id; MLflow (experiment `lorafleet-research/<study>`) holds one parent run per study and
one nested run per trial, found again by the tags `lorafleet.study` + `lorafleet.trial_number`.

Several processes on one study. Local: start `lorafleet research run CONFIG` more than once (same
config and --study); each takes the next trial from the shared storage, and the last to finish
writes the summary. Several machines: give every process the same PostgreSQL storage and MLflow
tracking server, e.g.

    export MLFLOW_TRACKING_URI=http://mlflow.internal:5000
    lorafleet research run configs/german-legal.yaml --storage postgresql://user:pw@db/optuna      # machine 1
    lorafleet research run configs/german-legal.yaml --storage postgresql://user:pw@db/optuna --worker  # others

(`--worker` only runs trials; `LORAFLEET_OPTUNA_STORAGE` can replace --storage). The trial cap counts
over the whole study, so concurrent processes may overshoot it by at most one trial each. A trial
whose process dies is noticed at once on the same host (pid check) or, on another host, after
`grace_s` without heartbeat; it is marked failed and its configuration is queued again.
"""

from __future__ import annotations

from typing import Any

# Heavy modules (optuna, mlflow, torch via train) load on first use, so `lorafleet --help` stays fast.
_EXPORTS = {
    "ResearchConfig": "config", "LoadedConfig": "config", "load_config": "config", "space_fingerprint": "config",
    "ResearchResult": "runner", "run_research": "runner", "loaded_from_study": "runner",
    "StudyError": "study", "TrainAPI": "objective",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
