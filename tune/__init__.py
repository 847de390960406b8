"""lorafleet.tune: serving-profile sweep of one adapter on this machine.

    run_tune(source, TuneConfig(...)) -> TuneResult(out_dir, profile, recommendation, results, front, …)

`source` is an adapter folder, a bundle folder, an MLflow run id or NAME@alias; see tune/run.py.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TuneConfig", "TuneError", "TuneResult", "TuneSource", "run_tune"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from lorafleet.tune import run

        return getattr(run, name)
    raise AttributeError(name)
