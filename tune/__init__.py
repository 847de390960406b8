"""lorafleet.tune: serving-profile sweep of one adapter on this machine.

A private local cluster (nats-server, gateway, one worker) serves the adapter; candidates (a worker's batching
profile, or an engine's options) are measured one after another under load, and the one with the best throughput
within the latency objective (and memory limit) is recommended. Precision is an axis too: each precision the
runtime supports is judged once against fp32 by a quality guard (precision.py; generative specialists: dev
ROUGE-L, generation_guard.py) and only the qualifying ones are measured. Outputs: profile.yaml, results.csv,
results.json, precisions.csv, a plot.

One driver, kinds as strategies: sweep.py is the one sweep driver (trials, cap and budget, progress, cleanup);
kind.py is the strategy a tune kind implements (probe, guard, candidate grid, finish), found by entry point
(`lorafleet.tune_kinds`). The rooms under kinds/ are named as train's kinds (retrieval, rerank, generation), so a
new task kind adds a folder of the same name in each stage; what the two batching kinds share (the gateway probe,
the profile recommendation) is batching.py, not one kind importing another. The driver and the shared modules
never import a room; rooms never import each other (import-linter contracts tune-driver, tune-kinds). tune may
import the ground floor (lorafleet.core, .models, .nats, .ops), never another stage.

Public API:
    run_tune(source: TuneSource, cfg: TuneConfig | None = None, out_dir=None, say=None) -> TuneResult
    from_adapter_dir(path, base=None) -> TuneSource       (registry refs, bundles, run ids: lorafleet.pipeline)
    TuneConfig, TuneSource, TuneResult, TuneError
"""

from __future__ import annotations

from typing import Any

__all__ = ["TuneConfig", "TuneError", "TuneResult", "TuneSource", "from_adapter_dir", "run_tune"]


def __getattr__(name: str) -> Any:
    if name in ("TuneConfig", "TuneError"):
        from lorafleet.tune import config

        return getattr(config, name)
    if name in ("TuneSource", "from_adapter_dir"):
        from lorafleet.tune import source

        return getattr(source, name)
    if name in ("TuneResult", "run_tune"):
        from lorafleet.tune import sweep

        return getattr(sweep, name)
    raise AttributeError(name)
