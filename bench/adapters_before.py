"""The `before` contender of bench/adapters.py: the sentence-transformers runtime as it served adapters before
mixed batches (issue 16), registered as the runtime plugin `sentence-transformers-before` so that it runs
side by side with today's code in one benchmark run.

One adapter per batch, switched with peft's `set_adapter` / `disable_adapters` (which walk every module of
every loaded adapter), adapters added and removed through transformers' `load_adapter` / `delete_adapter`.
Not for serving: it exists to measure what mixed batches replace.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from lorafleet.sidecar.st_runtime import SentenceTransformerRuntime


class _GeneralPathOnly:
    """Stands in for the constant-time LoRA slots: every add and remove takes transformers' path."""

    def targets(self, config: Any, tensors: Any) -> None:
        return None

    def remove(self, adapter_id: str) -> bool:
        return False

    def forget(self) -> None:
        pass


class BeforeMixedRuntime(SentenceTransformerRuntime):
    mixed_adapters: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = _GeneralPathOnly()  # type: ignore[assignment]

    def encode(self, texts: list[str], adapter_id: str | None) -> np.ndarray:
        self._activate(adapter_id)
        return self._raw_encode(texts)
