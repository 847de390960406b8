"""The runtime interface every inference backend implements, and the factory that finds one by name.

A runtime holds one base model and the LoRA adapters loaded onto it. It declares what it can do
(`capabilities`: `embed`, `generate`); the worker only calls the methods of a declared capability,
so nothing probes with hasattr. Runtimes are plugins: each registers a class under the entry-point
group `lorafleet.runtimes` (the built-in sentence-transformers runtime does too), and
`BaseModelSpec.runtime` names one. A broken, unknown or duplicate plugin stops the worker.

Contract:
- Thread: every method is called from the worker process's main thread (torch runs fastest there;
  the NATS event loop lives in a background thread and never calls a runtime).
- Process: a runtime may start helper processes (an engine in its own venv); `close` must stop
  them. Heavy imports happen in `__init__`, never at module import, so finding a plugin is cheap.
- Calls, in order: `__init__(spec, device)` once; then any number of `load_adapter` /
  `unload_adapter` / capability calls; `close` once. `load_adapter` raises
  `lorafleet.adapters.AdapterUnavailable` for an adapter that can never fit this base.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from lorafleet import plugins
from lorafleet.adapters import AdapterUnavailable
from lorafleet.config import BaseModelSpec
from lorafleet.device import resolve_device
from lorafleet.wire import CAPABILITIES, EMBED

__all__ = ["AdapterUnavailable", "Runtime", "create_runtime", "runtime_class"]


class Runtime(ABC):
    """One base model plus adapters, behind the capabilities it declares."""

    capabilities: ClassVar[frozenset[str]] = frozenset()

    # -- embed ---------------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        """Embedding dimension (embed)."""
        raise NotImplementedError(f"{type(self).__name__} does not embed")

    def encode(self, texts: list[str], adapter_id: str | None) -> np.ndarray:
        """float32 array (len(texts), dim); adapter_id None means the bare base model (embed)."""
        raise NotImplementedError(f"{type(self).__name__} does not embed")

    # -- adapters --------------------------------------------------------------------------------------
    @abstractmethod
    def load_adapter(self, adapter_id: str, path: str) -> None:
        """Load a peft adapter from a local directory under the name `adapter_id`."""

    @abstractmethod
    def unload_adapter(self, adapter_id: str) -> None: ...

    @abstractmethod
    def loaded_adapters(self) -> list[str]: ...

    def close(self) -> None:  # noqa: B027 - an optional hook with a no-op default, as the contract says
        """Free the model (and stop helper processes); the default does nothing."""


def runtime_class(name: str) -> type[Runtime]:
    """The runtime class registered as `name`; PluginError for unknown, broken or malformed plugins."""
    cls = plugins.load(plugins.RUNTIMES, name)
    if not (isinstance(cls, type) and issubclass(cls, Runtime)):
        raise plugins.PluginError(f"runtime plugin {name!r} is {cls!r}, not a subclass of lorafleet's Runtime")
    unknown = set(cls.capabilities) - set(CAPABILITIES)
    if not cls.capabilities or unknown:
        raise plugins.PluginError(f"runtime plugin {name!r} declares capabilities {sorted(cls.capabilities)}; "
                                  f"it must declare some of {', '.join(CAPABILITIES)}")
    return cls


def create_runtime(spec: BaseModelSpec, device: str = "auto") -> Runtime:
    """The runtime `spec.runtime` names, loaded with `spec`'s base model on `device`."""
    return runtime_class(spec.runtime)(spec, device=resolve_device(device))


def needs(runtime: Runtime, capability: str = EMBED) -> None:
    """Fail loudly when a runtime is asked for a capability it does not declare."""
    if capability not in runtime.capabilities:
        raise TypeError(f"{type(runtime).__name__} cannot {capability} (capabilities: "
                        f"{', '.join(sorted(runtime.capabilities))})")
