"""The runtime interface every inference backend implements, and the factory that finds one by name.

A runtime holds one base model and the LoRA adapters loaded onto it. It declares what it can do
(`capabilities`: `embed`, `generate`, `score`); the worker only calls the methods of a declared capability,
so nothing probes with hasattr. Runtimes are plugins: each registers a class under the entry-point
group `lorafleet.runtimes` (the built-ins do too), and `BaseModelSpec.runtime` names one. A broken,
unknown or duplicate plugin stops the worker.

Two ways to run, chosen by the base class a plugin subclasses (the pull loop never asks for a name):

- `Runtime`: in-process, batched by the worker. Every method is called from the worker process's
  main thread (torch runs fastest there; the NATS event loop lives in a background thread and never
  calls it). The worker pulls when the main thread is free and hands it whole batches of one
  (base, adapter): `encode` (embed) or `generate` (generate; text deltas go out through a `TokenSink`).
  Built-ins: `sentence-transformers`, `transformers` (generate, the light fallback), `synthetic`.
- `EngineRuntime`: an engine that batches continuously by itself (vLLM). Every method is a coroutine
  on the worker's event loop, one sequence per `stream` call; the worker keeps up to `slots`
  sequences in flight and pulls more as sequences finish (pull when free, counted in sequences).
  Built-in: `vllm`.

Contract (both):
- Process: a runtime may start helper processes (an engine in its own venv); `close` must stop
  them. Heavy imports happen in `__init__` (or `start`), never at module import, so finding a plugin
  is cheap.
- Precision: `precisions(device)` (a class method) declares the number formats it can serve a base at
  there (default fp32 only); `create_runtime` refuses an explicit `BaseModelSpec.precision` outside them,
  and the runtime sets `precision` to the one it serves (resolving `auto`, lorafleet/models/precision.py).
- Calls, in order: `__init__(spec, device)` once (an engine's `start()` next); then any number of
  `load_adapter` / `unload_adapter` / capability calls; `close` once. `load_adapter` raises
  `lorafleet.core.adapters.AdapterUnavailable` for an adapter that can never fit this base.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from lorafleet.core import plugins
from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.core.config import BaseModelSpec
from lorafleet.core.wire import CAPABILITIES, EMBED, GenerateParams
from lorafleet.models.device import resolve_device
from lorafleet.models.precision import JudgedModel, check_precision

__all__ = ["ABORTED", "AdapterUnavailable", "AdapterWeights",
           "EngineDown", "EngineRuntime", "EngineStats", "GenerateInput", "Generated",
           "RequestRefused", "Runtime", "TokenSink", "create_runtime", "runtime_class"]

# Finish reasons besides the engine's own ("stop", "length").
ABORTED = "abort"  # the sink said stop (cancelled, or past the deadline)


class RequestRefused(ValueError):
    """The runtime refuses this input or its parameters (a prompt over the context, …): answered, never retried."""


class EngineDown(RuntimeError):
    """An engine runtime's engine is gone (its process died): the worker restarts it, and retries the task."""


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """One sequence to generate: the prompt text (already rendered from the chat template when
    `params.chat`) and its sampling parameters."""

    prompt: str
    params: GenerateParams
    request_id: str = ""  # for the engine's log (the task id)


@dataclass(frozen=True, slots=True)
class Generated:
    """A finished sequence: the whole text (stop string and end-of-sequence token excluded), usage, and
    why it ended: "stop", "length" or `ABORTED`."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """An adapter read into host memory (the tier between the device and the local disk): what
    `Runtime.read_adapter` returns and `Runtime.load_adapter_weights` puts on the device."""

    path: str  # the folder it was read from
    nbytes: int  # bytes of its tensors, what the host tier counts
    config: Any = None  # the runtime's own objects (peft's LoraConfig, a state dict): opaque to the cache
    tensors: Any = field(default=None, repr=False)


class TokenSink(Protocol):
    """Where a batch runtime's `generate` sends text as it is produced (from the main thread)."""

    def delta(self, i: int, text: str) -> None:
        """More text of input `i` (only inputs whose parameters ask to stream need it)."""

    def stopped(self, i: int) -> bool:
        """Whether input `i` should stop now (its client went away, or its deadline passed): end it
        with the finish reason `ABORTED`."""


def check_row_adapters(rows: int, what: str, adapters: Sequence[str | None], loaded: Collection[str] | None = None,
                       base: str | None = None) -> None:
    """A mixed call's adapter ids: one per row (ValueError), and, given `loaded`, each named one loaded (KeyError)."""
    if len(adapters) != rows:
        raise ValueError(f"{rows} {what} but {len(adapters)} adapter ids")
    if loaded is not None:
        missing = sorted({a for a in adapters if a is not None and a not in loaded})
        if missing:
            raise KeyError(f"adapters {', '.join(map(repr, missing))} are not loaded on base {base!r}")


class Runtime(ABC):
    """One base model plus adapters, behind the capabilities it declares."""

    capabilities: ClassVar[frozenset[str]] = frozenset()
    # True when `encode_mixed` (or `score_mixed`) computes rows of different adapters in one forward pass; the
    # worker then forms batches per base instead of per (base, adapter).
    mixed_adapters: ClassVar[bool] = False
    # The precision the base is served at (lorafleet.models.precision): set by a runtime that resolves its spec's.
    precision: str = "fp32"

    @classmethod
    def precisions(cls, device: str) -> frozenset[str]:
        """The precisions (`fp32`, `bf16`, `fp16`, `int8`) this runtime can serve a base at on `device`; an
        explicit `BaseModelSpec.precision` outside them is a ConfigError at fleet load. Default: fp32 only."""
        return frozenset({"fp32"})

    def use_judged(self, models: Collection[JudgedModel], resolve: Callable[[str], Path] | None = None) -> object:
        """Optional hook, called once after the fleet state is read and before serving: each model served on this
        base, its tuned precision (None: none recorded) and adapter (`resolve` makes a URI a local folder). A
        runtime whose `auto` follows them resolves here (lorafleet.models.precision.served_precision).
        Default: nothing."""
        return None

    # -- embed ---------------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        """Embedding dimension (embed)."""
        raise NotImplementedError(f"{type(self).__name__} does not embed")

    def encode(self, texts: list[str], adapter_id: str | None) -> np.ndarray:
        """float32 array (len(texts), dim); adapter_id None means the bare base model (embed)."""
        raise NotImplementedError(f"{type(self).__name__} does not embed")

    def encode_mixed(self, texts: list[str], adapters: Sequence[str | None]) -> np.ndarray:
        """Like `encode`, with one adapter id per row (None: the bare base), rows in input order. Every named
        adapter is loaded. The default runs one `encode` per adapter; a runtime that sets `mixed_adapters`
        does it in one forward pass, with the same vectors."""
        check_row_adapters(len(texts), "texts", adapters)
        rows: dict[str | None, list[int]] = {}
        for i, adapter in enumerate(adapters):
            rows.setdefault(adapter, []).append(i)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for adapter, idx in rows.items():
            out[idx] = self.encode([texts[i] for i in idx], adapter)
        return out

    # -- generate --------------------------------------------------------------------------------------
    def generate(self, inputs: list[GenerateInput], adapter_id: str | None, sink: TokenSink) -> list[Generated]:
        """One `Generated` per input, in order (generate). Text goes to `sink.delta` as it is produced;
        an input whose `sink.stopped(i)` turns true ends with `ABORTED`. `RequestRefused` for inputs
        this model cannot take."""
        raise NotImplementedError(f"{type(self).__name__} does not generate")

    # -- score ---------------------------------------------------------------------------------------
    def score(self, pairs: list[tuple[str, str]], adapter_id: str | None) -> np.ndarray:
        """float32 array (len(pairs),): the relevance of each (query, document) pair (score); adapter_id None
        means the bare base. Pairs longer than the model's max length are truncated by the runtime."""
        raise NotImplementedError(f"{type(self).__name__} does not score")

    def score_mixed(self, pairs: list[tuple[str, str]], adapters: Sequence[str | None]) -> np.ndarray:
        """Like `score`, with one adapter id per pair (None: the bare base), in input order. Every named adapter is
        loaded. The default runs one `score` per adapter; a runtime that sets `mixed_adapters` does it in one
        forward pass, with the same scores."""
        check_row_adapters(len(pairs), "pairs", adapters)
        rows: dict[str | None, list[int]] = {}
        for i, adapter in enumerate(adapters):
            rows.setdefault(adapter, []).append(i)
        out = np.empty(len(pairs), dtype=np.float32)
        for adapter, idx in rows.items():
            out[idx] = self.score([pairs[i] for i in idx], adapter)
        return out

    # -- adapters --------------------------------------------------------------------------------------
    @abstractmethod
    def load_adapter(self, adapter_id: str, path: str) -> None:
        """Load a peft adapter from a local directory under the name `adapter_id`."""

    @abstractmethod
    def unload_adapter(self, adapter_id: str) -> None: ...

    @abstractmethod
    def loaded_adapters(self) -> list[str]: ...

    def read_adapter(self, adapter_id: str, path: str) -> AdapterWeights | None:
        """The adapter at `path` read into host memory, for `load_adapter_weights`; None (the default) when this
        runtime loads from disk only (the worker then keeps no host tier for it). AdapterUnavailable as
        `load_adapter`."""
        return None

    def load_adapter_weights(self, adapter_id: str, weights: AdapterWeights) -> None:
        """Load an adapter from its host-memory copy; the default loads it from the folder it was read from."""
        self.load_adapter(adapter_id, weights.path)

    def close(self) -> None:  # noqa: B027 - an optional hook with a no-op default, as the contract says
        """Free the model (and stop helper processes); the default does nothing."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int = 0  # sequences the engine is decoding
    waiting: int = 0  # sequences queued inside the engine
    kv_cache_usage: float = 0.0  # 0..1


class EngineRuntime(ABC):
    """An engine that batches continuously by itself, driven on the worker's event loop (generate).

    Every method is a coroutine (or cheap) and runs on the worker's event loop, in the thread that
    owns it for the worker's whole life (an engine process may be tied to the thread that started it).
    """

    capabilities: ClassVar[frozenset[str]] = frozenset()
    precision: str = "fp32"  # as Runtime's
    # The engine uses the host's cores (or GPU) itself: `lorafleet up` starts one worker, not one per CPU.
    one_worker_per_host: ClassVar[bool] = True

    @classmethod
    def precisions(cls, device: str) -> frozenset[str]:
        """As `Runtime.precisions`: what the engine can serve a base at on `device` (default fp32 only)."""
        return frozenset({"fp32"})

    def use_judged(self, models: Collection[JudgedModel], resolve: Callable[[str], Path] | None = None) -> object:
        """As `Runtime.use_judged`, before `start`. Default: nothing to do."""
        return None

    @abstractmethod
    async def start(self) -> None:
        """Start the engine and return once it serves; raise with its log when it cannot."""

    @property
    @abstractmethod
    def slots(self) -> int:
        """How many sequences the worker keeps in flight on this engine (its slot target)."""

    @abstractmethod
    def stream(self, item: GenerateInput, adapter_id: str | None) -> AsyncIterator[str | Generated]:
        """Text deltas in order, then one `Generated`. Closing the iterator (or cancelling the task that
        drives it) aborts the sequence in the engine. `RequestRefused` for an input the engine refuses,
        `EngineDown` when the engine died (the worker calls `restart`); any other exception is transient
        (the task is retried)."""

    @abstractmethod
    async def load_adapter(self, adapter_id: str, path: str) -> None: ...

    @abstractmethod
    async def unload_adapter(self, adapter_id: str) -> None: ...

    @abstractmethod
    def loaded_adapters(self) -> list[str]: ...

    @property
    def adapter_capacity(self) -> int | None:
        """Adapters the engine itself keeps cheaply at hand (vLLM: max_cpu_loras, in host memory); the worker
        keeps that many loaded instead of its own `max_adapters`. None: the engine has no such cache."""
        return None

    async def stats(self) -> EngineStats:
        """What the engine reports (heartbeats carry the KV-cache use); the default knows nothing."""
        return EngineStats()

    async def restart(self) -> None:
        """Start the engine again after it died (adapters are loaded again on demand); default: start()."""
        await self.start()

    async def close(self) -> None:  # noqa: B027 - an optional hook with a no-op default, as the contract says
        """Stop the engine and everything it started."""


AnyRuntime = Runtime | EngineRuntime


def runtime_class(name: str) -> type[Runtime] | type[EngineRuntime]:
    """The runtime class registered as `name`; PluginError for unknown, broken or malformed plugins."""
    cls = plugins.load(plugins.RUNTIMES, name)
    if not (isinstance(cls, type) and issubclass(cls, Runtime | EngineRuntime)):
        raise plugins.PluginError(f"runtime plugin {name!r} is {cls!r}, not a subclass of lorafleet's Runtime "
                                  "or EngineRuntime")
    unknown = set(cls.capabilities) - set(CAPABILITIES)
    if not cls.capabilities or unknown:
        raise plugins.PluginError(f"runtime plugin {name!r} declares capabilities {sorted(cls.capabilities)}; "
                                  f"it must declare some of {', '.join(CAPABILITIES)}")
    return cls


def create_runtime(spec: BaseModelSpec, device: str = "auto") -> AnyRuntime:
    """The runtime `spec.runtime` names, loaded with `spec`'s base model on `device` (an engine: configured,
    not started)."""
    cls = runtime_class(spec.runtime)
    device = resolve_device(device)
    check_precision(spec.name, spec.runtime, spec.precision, cls.precisions(device), device)  # never a fallback
    return cls(spec, device=device)  # type: ignore[call-arg]


def needs(runtime: AnyRuntime, capability: str = EMBED) -> None:
    """Fail loudly when a runtime is asked for a capability it does not declare."""
    if capability not in runtime.capabilities:
        raise TypeError(f"{type(runtime).__name__} cannot {capability} (capabilities: "
                        f"{', '.join(sorted(runtime.capabilities))})")
