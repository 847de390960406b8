"""The real lorafleet worker (sidecar) with a synthetic runtime, for bench/routing.py.

A batch of n tasks costs `slowdown × (a + b·n)` ms, spent sleeping, so the dispatch policy is what
is measured and not this machine's two cores. Everything else is the real sidecar: pull loop,
batcher, ack table, heartbeats. The runtime is swapped in by replacing the worker module's
`create_runtime` factory before `run_worker` starts (the sidecar has no runtime plugin setting
yet); bases whose model is not in `--costs` keep the real runtime (MiniLM).

A base named `MODEL--WORKER` is MODEL's queue private to one worker: the push router in
bench/routing.py sends a worker its tasks that way, through the very same worker code.

    python -m lorafleet.bench.synth_worker --fleet F --nats-url U --worker-id W --costs '{"m": [30, 4]}'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np

from lorafleet.config import BaseModelSpec, WorkerConfig

SYNTH_DIM = 8


def model_of(base: str) -> str:
    return base.split("--", 1)[0]


class SyntheticRuntime:
    """Implements lorafleet.sidecar.runtime.Runtime; encode sleeps for the batch's modelled cost."""

    def __init__(self, a_ms: float, b_ms: float, slowdown: float = 1.0) -> None:
        self.a_ms, self.b_ms, self.slowdown = a_ms, b_ms, slowdown
        self._adapters: list[str] = []

    @property
    def dim(self) -> int:
        return SYNTH_DIM

    def cost_s(self, n: int) -> float:
        return self.slowdown * (self.a_ms + self.b_ms * n) / 1000.0

    def encode(self, texts: list[str], adapter_id: str | None) -> np.ndarray:
        time.sleep(self.cost_s(len(texts)))
        out = np.zeros((len(texts), SYNTH_DIM), dtype=np.float32)
        out[:, 0] = 1.0
        return out

    def load_adapter(self, adapter_id: str, path: str) -> None:
        self._adapters.append(adapter_id)

    def unload_adapter(self, adapter_id: str) -> None:
        if adapter_id in self._adapters:
            self._adapters.remove(adapter_id)

    def loaded_adapters(self) -> list[str]:
        return list(self._adapters)

    def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lorafleet.bench.synth_worker",
                                description="A lorafleet worker whose runtime sleeps a + b·n ms per batch "
                                            "(benchmarks).")
    p.add_argument("--fleet", required=True, help="FleetConfig YAML.")
    p.add_argument("--nats-url", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--base", action="append", default=None, help="Serve only this base (repeatable).")
    p.add_argument("--costs", default="{}", help='JSON {"MODEL": [a_ms, b_ms]}; other models use the real runtime.')
    p.add_argument("--slowdown", type=float, default=1.0, help="Multiply every batch's cost (a slower worker).")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s worker={args.worker_id} %(name)s: %(message)s")
    from lorafleet.config import FleetConfig, load_yaml_model
    from lorafleet.sidecar import worker as sidecar_worker

    costs: dict[str, list[float]] = json.loads(args.costs)
    real_factory = sidecar_worker.create_runtime

    def factory(spec: BaseModelSpec, cfg: WorkerConfig):  # type: ignore[no-untyped-def]
        cost = costs.get(model_of(spec.name))
        if cost is None:
            return real_factory(spec, cfg)
        return SyntheticRuntime(float(cost[0]), float(cost[1]), args.slowdown)

    sidecar_worker.create_runtime = factory  # the hook: see the module docstring
    fleet = load_yaml_model(FleetConfig, args.fleet)
    return sidecar_worker.run_worker(fleet, nats_url=args.nats_url, worker_id=args.worker_id, bases=args.base)


if __name__ == "__main__":
    sys.exit(main())
