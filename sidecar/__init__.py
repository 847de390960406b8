"""lorafleet.sidecar: the runtime-agnostic worker.

A worker pulls tasks from the JetStream work queue (one durable consumer per base model, shared
by all its workers), forms its own batches under a token budget, runs a runtime (a plugin behind
`runtime.Runtime`, found by name through the entry-point group `lorafleet.runtimes`), replies to
the gateway's inbox with a receipt and then settles the task by the ack table.

Modules: worker (process entry, main-thread compute), connection (NATS side in a background
thread), scheduler (when and what to pull for batch runtimes), intake (decode, hold, refuse), batcher,
pull (fetch steps, arrival rate, batch time), settle (replies and acks), acks (the table), adapters
(per-base adapter LRU), generation (a generate batch in the main thread), streaming (chunks and
cancellation), engines / engine_lane / engine_adapters (engine runtimes: one lane per base, pull when a
sequence slot is free), runtime (the plugin interface), st_runtime, transformers_runtime, vllm_runtime
(the built-in runtimes), vllm_engine / vllm_protocol / vllm_files / vllm_install (vLLM's server in its own
venv).

Public API:
    run_worker(fleet, nats_url=None, worker_id=None, bases=None) -> exit code   (main thread only)
    Runtime, EngineRuntime, runtime_class(name), create_runtime(spec, device)   (the runtime plugin interface)
Start one with `python -m lorafleet.sidecar --fleet FLEET.yaml`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EngineRuntime", "Runtime", "create_runtime", "run_worker", "runtime_class"]


def __getattr__(name: str) -> Any:
    # Lazy, so importing a pure-logic module of this package does not pull in the worker.
    if name == "run_worker":
        from lorafleet.sidecar.worker import run_worker

        return run_worker
    if name in ("EngineRuntime", "Runtime", "create_runtime", "runtime_class"):
        from lorafleet.sidecar import runtime

        return getattr(runtime, name)
    raise AttributeError(name)
