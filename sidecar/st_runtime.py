"""sentence-transformers runtime: one base model in memory, many peft LoRA adapters switched per batch."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import ClassVar

import numpy as np

from lorafleet.adapters import AdapterUnavailable
from lorafleet.config import BaseModelSpec
from lorafleet.models import resolve_model_source
from lorafleet.sidecar.runtime import Runtime
from lorafleet.wire import EMBED

log = logging.getLogger(__name__)


def _quiet_transformers() -> None:
    # peft/transformers print a per-adapter load report and progress bars; a worker logs its own lines.
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


class SentenceTransformerRuntime(Runtime):
    """The embed capability on a SentenceTransformer; adapters via its peft integration (plugin name
    `sentence-transformers`)."""

    capabilities: ClassVar[frozenset[str]] = frozenset({EMBED})

    def __init__(self, spec: BaseModelSpec, device: str = "cpu") -> None:
        from sentence_transformers import SentenceTransformer, models

        _quiet_transformers()
        self.spec = spec
        self.device = device
        source = resolve_model_source(spec.source)
        model = SentenceTransformer(source, device=device, revision=spec.revision)
        has_normalize = any(isinstance(m, models.Normalize) for m in model)
        self._normalize_in_encode = False
        if spec.normalize is True and not has_normalize:
            self._normalize_in_encode = True
        elif spec.normalize is False and has_normalize:
            model = SentenceTransformer(
                modules=[m for m in model if not isinstance(m, models.Normalize)], device=device
            )
        if spec.max_seq_length is not None:
            model.max_seq_length = spec.max_seq_length
        model.eval()
        self.model = model
        self.normalized = has_normalize if spec.normalize is None else spec.normalize
        dim = model.get_embedding_dimension()
        if dim is None:
            dim = int(self._raw_encode(["dimension probe"]).shape[1])
        self._dim = int(dim)
        self._adapters: list[str] = []
        self._state: tuple[bool, str | None] | None = None  # (adapters enabled, active); None = unknown
        log.info("loaded base %s from %s on %s (dim %d, max_seq_length %s, normalized %s)",
                 spec.name, source, device, self._dim, model.max_seq_length, self.normalized)

    @property
    def dim(self) -> int:
        return self._dim

    def _raw_encode(self, texts: list[str]) -> np.ndarray:
        arr = self.model.encode(
            texts, batch_size=max(len(texts), 1), convert_to_numpy=True,
            normalize_embeddings=self._normalize_in_encode, show_progress_bar=False,
        )
        return np.asarray(arr, dtype=np.float32)

    def _activate(self, adapter_id: str | None) -> None:
        if adapter_id is None:
            if self._adapters and self._state != (False, None):
                self.model.disable_adapters()
                self._state = (False, None)
            return
        if adapter_id not in self._adapters:
            raise KeyError(f"adapter {adapter_id!r} is not loaded on base {self.spec.name!r}")
        if self._state == (True, adapter_id):
            return
        if self._state is None or not self._state[0]:
            self.model.enable_adapters()
        self.model.set_adapter(adapter_id)
        self._state = (True, adapter_id)

    def encode(self, texts: list[str], adapter_id: str | None) -> np.ndarray:
        self._activate(adapter_id)
        return self._raw_encode(texts)

    def load_adapter(self, adapter_id: str, path: str) -> None:
        config = Path(path) / "adapter_config.json"
        try:
            recorded = json.loads(config.read_text()).get("base_model_name_or_path")
        except (OSError, ValueError) as exc:
            raise AdapterUnavailable(f"adapter {adapter_id!r}: cannot read {config}: {exc}") from exc
        # The recorded base is wherever training ran; we load the weights onto our own base instead.
        log.info("loading adapter %s from %s onto base %s (trained on %s)", adapter_id, path, self.spec.name, recorded)
        try:
            with warnings.catch_warnings():
                # peft warns on every second adapter; several adapters on one base is the point here.
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                self.model.load_adapter(path, adapter_name=adapter_id, hotswap=False)
        except (ValueError, KeyError, TypeError) as exc:
            # peft raises these for adapters that do not fit this base (wrong target modules, shapes).
            self._forget_partial(adapter_id)
            msg = f"adapter {adapter_id!r} from {path} does not fit base {self.spec.name!r}: {exc}"
            raise AdapterUnavailable(msg) from exc
        except BaseException:
            self._forget_partial(adapter_id)
            raise
        finally:
            self._state = None
        self._adapters.append(adapter_id)

    def _forget_partial(self, adapter_id: str) -> None:
        # A failed load can leave the adapter half-registered in peft; remove it so a retry starts clean.
        try:
            self.model.delete_adapter(adapter_id)
        except Exception:
            log.debug("no partial adapter %s to remove", adapter_id)

    def unload_adapter(self, adapter_id: str) -> None:
        if adapter_id not in self._adapters:
            return
        self.model.delete_adapter(adapter_id)
        self._adapters.remove(adapter_id)
        self._state = None

    def loaded_adapters(self) -> list[str]:
        return list(self._adapters)

    def close(self) -> None:
        self._adapters.clear()
        del self.model
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
