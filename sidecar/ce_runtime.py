"""The `score` capability on a sentence-transformers CrossEncoder (plugin name `cross-encoder`).

A cross-encoder reads a (query, document) pair together and answers one relevance float: what
/v1/rerank serves. The base is loaded with one output (`num_labels=1`), so a plain BERT checkpoint
(the packaged MiniLM) becomes a cross-encoder with a fresh classification head. That head is drawn
from a fixed seed (`FRESH_HEAD_SEED`): every worker of the base, on any host, scores alike. Such a head ranks at
chance, so the base serves only its adapters (`trained_head` False: the worker refuses its bare score tasks, the
gateway answers 409; lorafleet/models/checkpoints.py decides from the checkpoint's weights); a checkpoint that ships its
head (a hub cross-encoder) serves by itself too.

Adapters are peft LoRAs of task type SEQ_CLS trained with `modules_to_save=["classifier"]`: the
head travels with the adapter (peft wraps it, one copy per adapter), so switching adapters switches
heads too and the bare base keeps its own. An adapter saved without its head would score with the
base's head: it is refused when loaded (`AdapterUnavailable`), never served silently wrong.

A call with one adapter goes through `CrossEncoder.predict`, which cuts its pairs into model batches of
`batch_size`, longest first. A mixed call (`score_mixed`: pairs of several adapters, or adapters and the bare
base, which the worker forms when `mixed_adapter_batches` is on) is one forward pass in which peft's mixed-batch
forward gives each row its own adapter's LoRA updates and its own head; the caller (`sidecar/scoring.py`) has
already cut it by length under the token budget. Its scores equal one `score` call per adapter.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.core.config import BaseModelSpec
from lorafleet.core.model_source import resolve_model_source
from lorafleet.core.wire import SCORE
from lorafleet.models.checkpoints import head_in_checkpoint
from lorafleet.sidecar.runtime import Runtime, check_row_adapters

log = logging.getLogger(__name__)

FRESH_HEAD_SEED = 0  # the seed a head missing from the checkpoint is drawn from (the same on every worker)
HEAD_MODULE = "classifier"  # BERT-style sequence classification head: what adapters must save
_UNKNOWN = object()  # no adapter state known (after a load or unload, which may change it)


def load_cross_encoder(source: str, device: str = "cpu", revision: str | None = None,
                       max_length: int | None = None) -> Any:
    """A CrossEncoder with one output from `source`; a head the checkpoint lacks is drawn from FRESH_HEAD_SEED
    (the caller's RNG state is left as it was)."""
    import torch
    from sentence_transformers.cross_encoder import CrossEncoder

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(FRESH_HEAD_SEED)
        model = CrossEncoder(source, num_labels=1, device=device, revision=revision, max_length=max_length)
    model.model.eval()
    return model


def _saves_head(path: str) -> bool:
    try:
        config = json.loads((Path(path) / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise AdapterUnavailable(f"no readable adapter_config.json in {path}: {exc}") from exc
    saved = config.get("modules_to_save") or []
    return any(m == HEAD_MODULE or str(m).endswith(f".{HEAD_MODULE}") for m in saved)


class CrossEncoderRuntime(Runtime):
    """(query, document) pairs → relevance scores; LoRA adapters carry their own classification head."""

    capabilities: ClassVar[frozenset[str]] = frozenset({SCORE})
    mixed_adapters: ClassVar[bool] = True

    def __init__(self, spec: BaseModelSpec, device: str = "cpu") -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # the "newly initialized" report: this module's log line says it once
        hf_logging.disable_progress_bar()
        self.spec = spec
        self.device = device
        source = resolve_model_source(spec.source)
        self.model = load_cross_encoder(source, device, spec.revision, spec.max_seq_length)
        # False: the head was drawn here (the checkpoint has none), so the bare base may not score by itself; None
        # (weights not readable, e.g. a format this cannot list) serves as before.
        self.trained_head: bool | None = head_in_checkpoint(source, spec.revision)
        self.batch_size = int(spec.options.get("batch_size", 32)) if spec.options else 32
        self._adapters: list[str] = []
        # The adapter set on the model; None: adapters disabled (the bare base); _UNKNOWN: set it again.
        self._active: str | object | None = _UNKNOWN
        self._modules: list[Any] | None = None  # the modules that take adapter_names; None: find them again
        log.info("loaded cross-encoder base %s from %s on %s (max_length %s)%s", spec.name, source, device,
                 self.max_length, "; its score head was drawn (the checkpoint has none): only adapters with their "
                 "own head answer" if self.trained_head is False else "")

    @property
    def max_length(self) -> int | None:
        """Pairs longer than this many tokens are truncated (the model's own limit)."""
        return self.model.max_length

    def _activate(self, adapter_id: str | None) -> None:
        if adapter_id == self._active:
            return
        if adapter_id is not None and adapter_id not in self._adapters:
            raise KeyError(f"adapter {adapter_id!r} is not loaded")
        # transformers' enable_adapters/disable_adapters reach the LoRA layers but not peft's wrappers of the saved
        # head (ModulesToSaveWrapper): a head disabled once would stay the base's. Switch both kinds here.
        if adapter_id is not None:
            self.model.model.set_adapter(adapter_id)
        for module in self._adapter_modules():
            module.enable_adapters(adapter_id is not None)
        self._active = adapter_id

    def score(self, pairs: list[tuple[str, str]], adapter_id: str | None) -> np.ndarray:
        if not pairs:
            return np.zeros(0, dtype=np.float32)
        self._activate(adapter_id)
        scores = self.model.predict([list(p) for p in pairs], batch_size=self.batch_size, show_progress_bar=False,
                                    convert_to_numpy=True)
        return np.asarray(scores, dtype=np.float32).reshape(len(pairs))

    def score_mixed(self, pairs: list[tuple[str, str]], adapters: Sequence[str | None]) -> np.ndarray:
        check_row_adapters(len(pairs), "pairs", adapters, self._adapters, self.spec.name)
        if not pairs:
            return np.zeros(0, dtype=np.float32)
        if len(set(adapters)) == 1:
            return self.score(pairs, adapters[0])
        import torch
        from sentence_transformers.util import batch_to_device

        from lorafleet.sidecar.st_lora import BASE_ROW, named_rows

        # The named rows need the adapter layers and head wrappers enabled: which adapter is active does not matter.
        self._activate(next(a for a in adapters if a is not None))
        model = self.model
        with named_rows(self._adapter_modules(), [BASE_ROW if a is None else a for a in adapters]), \
                torch.inference_mode():
            features = batch_to_device(model.preprocess([list(p) for p in pairs]), model.device)
            scores = model(features)["scores"].float()  # as predict: its activation, one label squeezed
            if model.activation_fn is not None:
                scores = model.activation_fn(scores)
            return scores.reshape(len(pairs)).cpu().numpy().astype(np.float32, copy=False)

    def _adapter_modules(self) -> list[Any]:
        """The LoRA layers and the head's wrappers: the modules that take `adapter_names` (found once per adapter
        set: a walk over the model)."""
        if self._modules is None:
            from peft.tuners.tuners_utils import BaseTunerLayer
            from peft.utils.other import AuxiliaryTrainingWrapper

            kinds = (BaseTunerLayer, AuxiliaryTrainingWrapper)
            self._modules = [m for m in self.model.model.modules() if isinstance(m, kinds)]
        return self._modules

    def load_adapter(self, adapter_id: str, path: str) -> None:
        if adapter_id in self._adapters:
            return
        if not _saves_head(path):
            raise AdapterUnavailable(f"adapter {adapter_id!r} at {path} does not save the '{HEAD_MODULE}' head "
                                     "(train it with modules_to_save=['classifier']); it would score with a random "
                                     "head")
        try:
            self.model.load_adapter(path, adapter_name=adapter_id)
        except (ValueError, RuntimeError, KeyError) as exc:  # shapes or target modules of another base
            self._forget(adapter_id)
            raise AdapterUnavailable(f"adapter {adapter_id!r} does not fit base {self.spec.name!r}: {exc}") from exc
        self._adapters.append(adapter_id)
        self._active = _UNKNOWN  # loading may change the active adapter: set it again
        self._modules = None

    def _forget(self, adapter_id: str) -> None:
        with contextlib.suppress(Exception):  # nothing of it may have been added
            self.model.model.delete_adapter(adapter_id)
        self._active = _UNKNOWN
        self._modules = None

    def unload_adapter(self, adapter_id: str) -> None:
        if adapter_id not in self._adapters:
            return
        self._adapters.remove(adapter_id)
        self.model.model.delete_adapter(adapter_id)
        self._active = _UNKNOWN  # deleting may change the active adapter
        self._modules = None

    def loaded_adapters(self) -> list[str]:
        return list(self._adapters)

    def close(self) -> None:
        del self.model
