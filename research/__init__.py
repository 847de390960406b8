"""lorafleet.research: the auto-research loop (Optuna study over LoRA trainings, tracked in MLflow).

    lorafleet research run configs/german-legal.yaml [--trials N] [--budget-minutes M] [--study NAME]
    lorafleet research resume NAME

What a trial trains and how it is judged comes from the config's task kind (`task:`, default
retrieval; lorafleet.core.tasks): its dataset, training, evaluation, objective and direction, baseline,
and the margin rule that also gates promotion. This stage never imports a kind's implementation.

Python: `run_research(load_config(path), ...) -> ResearchResult`; `result.candidate` tells whether
`result.winner_adapter_dir` may be shipped (`lorafleet.pipeline.ship` tunes and registers it).

A new study's first trial trains the `train:` section as written (`research.start_from_config`, on by default:
its values of the searched parameters are queued with `study.enqueue_trial`; a value outside the space is
sampled instead, and the run says which), so the winner on dev is never worse than the config searched around.

State: the Optuna study (RDB storage, sqlite at LORAFLEET_HOME/optuna/optuna.db by default) holds the
trials, the config it was started with, the search-space fingerprint, the baseline and the MLflow
parent run id; MLflow (experiment `lorafleet-research/<study>`) holds one parent run per study and
one nested run per trial, found again by the tags `lorafleet.study` + `lorafleet.trial_number`.

Several processes on one study. Local: start `lorafleet research run CONFIG` more than once (same
config and --study); each takes the next trial from the shared storage, and the last to finish
writes the summary. Several machines: give every process the same PostgreSQL storage (driver:
`pip install 'lorafleet[postgres]'`) and MLflow tracking server (`mlflow server --serve-artifacts`), e.g.

    export MLFLOW_TRACKING_URI=http://mlflow.internal:5000
    export LORAFLEET_OPTUNA_STORAGE=postgresql+psycopg://user:pw@db:5432/optuna
    lorafleet research run configs/german-legal.yaml            # machine 1
    lorafleet research run configs/german-legal.yaml --worker   # others

Each trial logs its adapter to its MLflow run (artifact `adapter`); the process that writes the
summary downloads the winner's adapter from there, so no machine needs another's disk.

(`--worker` only runs trials; `--storage URL` can replace LORAFLEET_OPTUNA_STORAGE). The trial cap counts
over the whole study, so concurrent processes may overshoot it by at most one trial each. A trial
whose process dies is noticed at once on the same host (pid check) or, on another host, after
`grace_s` without heartbeat; it is marked failed and its configuration is queued again.

Public API: load_config, from_raw, LoadedConfig, ResearchConfig, space_fingerprint, run_research,
loaded_from_study, ResearchResult, StudyError.
"""

from __future__ import annotations

from typing import Any

_CONFIG = {"ResearchConfig", "LoadedConfig", "load_config", "from_raw", "space_fingerprint"}
_RUNNER = {"run_research", "loaded_from_study"}

__all__ = sorted(_CONFIG | _RUNNER | {"ResearchResult", "StudyError"})


def __getattr__(name: str) -> Any:
    # Heavy modules (optuna, mlflow) load on first use, so `lorafleet --help` stays fast.
    if name in _CONFIG:
        from lorafleet.research import config

        return getattr(config, name)
    if name in _RUNNER:
        from lorafleet.research import runner

        return getattr(runner, name)
    if name == "ResearchResult":
        from lorafleet.research.result import ResearchResult

        return ResearchResult
    if name == "StudyError":
        from lorafleet.research.study import StudyError

        return StudyError
    raise AttributeError(name)
