"""The runtime interface every inference backend implements, and the factory that picks one.

The worker only ever calls these methods, always from the main thread of its process.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from lorafleet.config import BaseModelSpec, WorkerConfig


class AdapterUnavailable(RuntimeError):
    """The adapter cannot be used by this worker, and retrying will not change that."""


@runtime_checkable
class Runtime(Protocol):
    @property
    def dim(self) -> int:
        """Embedding dimension."""
        ...

    def encode(self, texts: list[str], adapter_id: str | None) -> np.ndarray:
        """float32 array (len(texts), dim); adapter_id None means the bare base model."""
        ...

    def load_adapter(self, adapter_id: str, path: str) -> None:
        """Load a peft adapter from a local directory under the name `adapter_id`."""
        ...

    def unload_adapter(self, adapter_id: str) -> None: ...

    def loaded_adapters(self) -> list[str]: ...

    def close(self) -> None: ...


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def create_runtime(spec: BaseModelSpec, worker: WorkerConfig) -> Runtime:
    if spec.runtime == "sentence-transformers":
        from lorafleet.sidecar.st_runtime import SentenceTransformerRuntime

        return SentenceTransformerRuntime(spec, device=resolve_device(worker.device))
    raise ValueError(f"base {spec.name!r}: unknown runtime {spec.runtime!r}")
