"""lorafleet.sidecar: the runtime-agnostic worker.

Workers pull tasks from the JetStream work queue, group them by (base model, adapter), form
batches under a token budget, run a runtime (a plugin behind `runtime.Runtime`), reply over core
NATS and then ack. Start one with `python -m lorafleet.sidecar --fleet FLEET.yaml` or
`run_worker(fleet)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lorafleet.sidecar.worker import run_worker

__all__ = ["run_worker"]


def __getattr__(name: str) -> Any:
    # Lazy, so importing a pure-logic module of this package does not pull in the worker.
    if name == "run_worker":
        from lorafleet.sidecar.worker import run_worker

        return run_worker
    raise AttributeError(name)
