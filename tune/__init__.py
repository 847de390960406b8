"""lorafleet.tune: serving-profile sweep of one adapter on this machine.

A private local cluster (nats-server, gateway, one worker) serves the adapter; profiles (batch
items, token budget, wait window, batches in flight) are measured one after another under closed
and open loop load, and the one with the best throughput within the latency objective (and memory
limit) is recommended. Precision is an axis too: each precision the runtime supports is judged once
against fp32 by a quality guard (precision.py; generative specialists: dev ROUGE-L, generation_guard.py) and only
the qualifying ones are measured. Outputs:
profile.yaml, results.csv, results.json, precisions.csv, a throughput-vs-p99 plot.

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
