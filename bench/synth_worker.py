"""A synthetic runtime for bench/routing.py: the real lorafleet worker, with a model whose cost is modelled.

A batch of n tasks costs `slowdown × (a + b·n)` ms, spent sleeping, so the dispatch policy is what
is measured and not this machine's two cores. Everything else is the real sidecar: pull loop,
batcher, ack table, heartbeats. It is an ordinary runtime plugin (entry point `synthetic` in the
group `lorafleet.runtimes`): a fleet names it per base,

    bases: [{name: m, runtime: synthetic, options: {a_ms: 30, b_ms: 4, load_ms: 500}}]

(`load_ms`, default 0, is the modelled cold start: the runtime sleeps that long when it is created; `max_batch`,
default 0 for none, splits a larger batch into consecutive ones of at most that size.)

and `LORAFLEET_SYNTH_SLOWDOWN` (default 1) makes one worker process slower than its peers.
A base named `MODEL--WORKER` is MODEL's queue private to one worker: the push router in
bench/routing.py sends a worker its tasks that way, through the very same worker code.
"""

from __future__ import annotations

import os
import time
from typing import ClassVar

import numpy as np

from lorafleet.core.config import BaseModelSpec, ConfigError
from lorafleet.core.wire import EMBED
from lorafleet.sidecar.runtime import Runtime

SYNTH_DIM = 8
SLOWDOWN_ENV = "LORAFLEET_SYNTH_SLOWDOWN"


def model_of(base: str) -> str:
    return base.split("--", 1)[0]


class SyntheticRuntime(Runtime):
    """Embeds by sleeping for the batch's modelled cost; options `a_ms` and `b_ms` (per batch, per item)."""

    capabilities: ClassVar[frozenset[str]] = frozenset({EMBED})

    def __init__(self, spec: BaseModelSpec, device: str = "cpu") -> None:
        try:
            self.a_ms, self.b_ms = float(spec.options["a_ms"]), float(spec.options["b_ms"])
            self.slowdown = float(os.environ.get(SLOWDOWN_ENV, "1"))
            load_ms = float(spec.options.get("load_ms", 0.0))
            self.max_batch = int(spec.options.get("max_batch", 0))  # 0: one batch of any size
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"base {spec.name!r}: the synthetic runtime needs numeric options a_ms and b_ms "
                              f"(load_ms, if given, too; and a numeric {SLOWDOWN_ENV}): {exc}") from exc
        time.sleep(load_ms / 1000.0)  # the modelled cold start: reading and placing the weights
        self._adapters: list[str] = []

    @property
    def dim(self) -> int:
        return SYNTH_DIM

    def cost_s(self, n: int) -> float:
        """A batch beyond `max_batch` runs as consecutive batches of at most that size, as an engine would."""
        if self.max_batch and n > self.max_batch:
            full, rest = divmod(n, self.max_batch)
            return full * self.cost_s(self.max_batch) + (self.cost_s(rest) if rest else 0.0)
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
