"""sentence-transformers runtime: one base model in memory, many peft LoRA adapters.

`encode` switches the active adapter per batch; `encode_mixed` runs rows of different adapters in one forward
pass with peft's mixed-batch LoRA forward (each LoraLayer gets `adapter_names=`, one per row, "__base__" for
the bare base), which computes each adapter's low-rank update on its own rows only.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from pickle import UnpicklingError
from typing import Any, ClassVar

import numpy as np

from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.core.config import BaseModelSpec
from lorafleet.core.model_source import resolve_model_source
from lorafleet.core.wire import EMBED
from lorafleet.models.precision import (
    AUTO,
    AUTO_ENV,
    FP32,
    PRECISIONS,
    PROBE_PASSAGES,
    PROBE_SENTENCES,
    JudgedModel,
    ServedPrecision,
    Verdict,
    cache_key,
    candidates,
    check_precision,
    choose_auto,
    pinned_auto,
    served_precision,
    supported_precisions,
)
from lorafleet.sidecar.batcher import padding_cuts
from lorafleet.sidecar.pull import BatchTime
from lorafleet.sidecar.runtime import AdapterWeights, Runtime, check_row_adapters

log = logging.getLogger(__name__)

BASE_ROW = "__base__"  # peft's name for a row on the bare base in a mixed batch
# peft raises these for adapters that do not fit this base (wrong target modules, shapes).
_UNFIT = (ValueError, KeyError, TypeError)
# A forward pass's fixed cost in padded tokens, until the runtime has fitted its own (time = a + b·padded tokens),
# and the least it may count: at bf16 a smaller pass also computes less efficiently (issue 27: passes cut at 24
# tokens served no faster than one pass per batch), so only real jumps in length (short queries beside long
# passages) are cut. Clamped, since a fit on a shared machine can swing.
DEFAULT_PASS_OVERHEAD_TOKENS = 128.0
PASS_OVERHEAD_RANGE = (64.0, 4096.0)
# `auto` probes at most this many served models without a tuned verdict per base and worker start (use_judged).
MAX_PROBED_MODELS = 8
# For side-by-side benchmarks: LORAFLEET_PASS_CUTS=0 runs each batch in one forward pass, as before issue 27.
PASS_CUTS = os.environ.get("LORAFLEET_PASS_CUTS", "1") != "0"


def set_precision(model: Any, precision: str) -> None:
    """Put a SentenceTransformer's weights in `precision`: float formats cast every weight (the model's own
    config may name bf16 or fp16: fp32 casts those back); int8 quantises the Linear layers of the transformer
    dynamically (int8 weights, activations quantised per batch), on a float32 model."""
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if precision in dtypes:
        model.to(dtypes[precision])
        return
    if precision != "int8":
        raise ValueError(f"unknown precision {precision!r}")
    model.to(torch.float32)
    torch.ao.quantization.quantize_dynamic(model.transformers_model, {torch.nn.Linear}, dtype=torch.qint8,
                                           inplace=True)


def _adapter_digest(folder: Path) -> str:
    """sha256 over an adapter folder's files (names and contents): the probe's cache key for it."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _quiet_transformers() -> None:
    # peft/transformers print a per-adapter load report and progress bars; a worker logs its own lines.
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


class SentenceTransformerRuntime(Runtime):
    """The embed capability on a SentenceTransformer; adapters via its peft integration (plugin name
    `sentence-transformers`)."""

    capabilities: ClassVar[frozenset[str]] = frozenset({EMBED})
    mixed_adapters: ClassVar[bool] = True

    def __init__(self, spec: BaseModelSpec, device: str = "cpu") -> None:
        from sentence_transformers import SentenceTransformer, models

        from lorafleet.sidecar.st_lora import LoraSlots  # torch and peft: imported when a runtime is made

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
        self._source = source
        self._auto = False  # set by _resolve_precision: `auto` decides per served model in use_judged
        self.precision = self._resolve_precision(spec, device, source)
        self.served = ServedPrecision(self.precision, "auto: no served model judged yet, fp32 (the gated precision)"
                                      if self._auto else f"the fleet file sets {self.precision}")
        dim = model.get_embedding_dimension()
        if dim is None:
            dim = int(self._raw_encode(["dimension probe"]).shape[1])
        self._dim = int(dim)
        self._adapters: list[str] = []
        self._state: tuple[bool, str | None] | None = None  # (adapters enabled, active); None = unknown
        self._lora_modules: list[Any] | None = None  # the layers that take adapter_names; None = find them again
        self._unmixable: set[str] = set()  # loaded adapters peft cannot mix by rows (not plain LoRA, DoRA)
        self._slots = LoraSlots(model.transformers_model)  # adds and removes adapters in constant time
        self._pass_time = BatchTime()  # seconds of one forward pass against its padded tokens: its fixed cost
        log.info("loaded base %s from %s on %s (dim %d, max_seq_length %s, normalized %s, precision %s)",
                 spec.name, source, device, self._dim, model.max_seq_length, self.normalized, self.precision)

    @classmethod
    def precisions(cls, device: str) -> frozenset[str]:
        # bf16/fp16 cast the weights (adapters keep their saved dtype, st_lora.py); int8 quantises the Linear
        # layers dynamically (CPU; no adapters on it, see load_adapter).
        return supported_precisions(device)

    def _resolve_precision(self, spec: BaseModelSpec, device: str, source: str) -> str:
        """Apply the spec's precision to the model; `auto` starts at fp32 and decides per served model once the
        worker knows them (use_judged)."""
        supported = self.precisions(device)
        check_precision(spec.name, spec.runtime, spec.precision, supported, device)
        if spec.precision != AUTO:
            set_precision(self.model, spec.precision)
            return spec.precision
        pinned = pinned_auto(supported)
        if pinned is not None:
            log.info("base %s: precision auto → %s (pinned by %s)", spec.name, pinned, AUTO_ENV)
            set_precision(self.model, pinned)
            return pinned
        set_precision(self.model, FP32)  # the reference, whatever dtype the checkpoint's config names
        self._auto = True
        return FP32

    def use_judged(self, models: Collection[JudgedModel], resolve: Callable[[str], Path] | None = None
                   ) -> ServedPrecision:
        """Under `auto`, per served model (issue 39): its tuned verdict (tune's guard, on its dev set with the
        adapter loaded) where the bundle has one, else a probe of the base with its adapter (`resolve` makes its
        URI a folder) on statute-length passages and short queries; the bare base alone when no model is served.
        The base, one copy for every adapter, serves the precision all of them passed (fp32 otherwise). Called
        once, before any adapter loads; an explicit precision stays as set (an override where a model was judged
        at another)."""
        supported = self.precisions(self.device)
        if not self._auto:
            verdict = served_precision(self.precision, [m.judged for m in models], supported)
            self.served = verdict if verdict.override else self.served
            return self.served
        # int8 is no candidate: a quantised base takes no adapters, and `auto` must not take them away silently.
        tries = [p for p in candidates(supported) if p != "int8"]
        verdicts: list[str | None] = []
        unjudged: list[JudgedModel] = []
        for m in models or [JudgedModel(None)]:
            if m.judged in PRECISIONS and m.judged != "int8":
                verdicts.append(m.judged)
            elif not tries:
                verdicts.append(FP32)
            else:
                unjudged.append(m)
        # A probe costs a copy of the base and two encodes (~2 s for MiniLM on 2 CPUs): a fleet file listing hundreds
        # of untuned adapters probes a fixed sample of them, and the base serves what the strictest of those passed.
        unjudged.sort(key=lambda m: m.adapter_id or m.adapter or "")
        verdicts += [self._probe_model(m, tries, resolve).precision for m in unjudged[:MAX_PROBED_MODELS]]
        if len(unjudged) > MAX_PROBED_MODELS:
            log.info("base %s: probed %d of %d models without a tuned verdict; the others count as the strictest of "
                     "those", self.spec.name, MAX_PROBED_MODELS, len(unjudged))
        verdict = served_precision(AUTO, verdicts, supported)
        set_precision(self.model, verdict.precision)
        self.precision, self.served = verdict.precision, verdict
        log.info("base %s: precision auto → %s (%s)", self.spec.name, verdict.precision, verdict.reason)
        return verdict

    def _probe_model(self, m: JudgedModel, tries: list[str], resolve: Callable[[str], Path] | None) -> Verdict:
        """The probe's verdict on one served model without a tuned one, cached per (base, adapter content,
        device); a model whose adapter cannot be found here counts as judged at fp32 only."""
        folder: Path | None = None
        digest = ""
        if m.adapter is not None:
            try:
                folder = resolve(m.adapter) if resolve is not None else Path(m.adapter)
                digest = _adapter_digest(folder)
            except Exception as exc:  # a missing adapter fails when requested; here it only keeps fp32
                log.warning("base %s: cannot probe adapter %s (%s): counted at fp32", self.spec.name, m.adapter, exc)
                return Verdict(FP32, {})
        key = cache_key(self.spec.runtime, self._source, self.spec.revision, self.device, tries) \
            + (f"|adapter {digest}" if folder is not None else "|base")
        texts = [*PROBE_PASSAGES, *PROBE_SENTENCES]
        verdict = choose_auto(key, tries, lambda p: self._probe(texts, p, folder))
        log.info("base %s: %s probed: %s", self.spec.name, m.adapter_id or m.adapter or "the bare base",
                 verdict.reason())
        return verdict

    def _probe(self, texts: list[str], precision: str, adapter: Path | None = None) -> np.ndarray:
        """The vectors of `texts` on a copy of the fp32 base at `precision` (casting there and back would round
        the weights), with `adapter` loaded on it where given: the probe holds a second copy of the base for a
        moment, once per model and device."""
        if precision == FP32 and adapter is None:
            return self._raw_encode(texts)
        model = copy.deepcopy(self.model)
        set_precision(model, precision)
        if adapter is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                model.load_adapter(str(adapter), adapter_name="probe")
            model.set_adapter("probe")
        try:
            return self._encode_with(model, texts)
        finally:
            del model

    @property
    def dim(self) -> int:
        return self._dim

    def _raw_encode(self, texts: list[str]) -> np.ndarray:
        """Encode a batch in forward passes cut where lengths jump (batcher.padding_cuts): a batch of arrivals is
        otherwise padded to its longest row, which the length-sorted ceiling never pays."""
        if len(texts) < 3 or not PASS_CUTS or not hasattr(self, "_pass_time"):  # the dimension probe: no fit yet
            return self._encode_with(self.model, texts)
        lengths = self._token_lengths(texts)
        order = sorted(range(len(texts)), key=lengths.__getitem__)
        cuts = padding_cuts([lengths[i] for i in order], self._pass_overhead())
        parts: list[np.ndarray] = []
        start = 0
        for end in cuts:
            rows = order[start:end]
            t0 = time.perf_counter()
            parts.append(self._encode_with(self.model, [texts[i] for i in rows]))
            self._pass_time.observe(len(rows) * lengths[rows[-1]], time.perf_counter() - t0)
            start = end
        if len(parts) == 1:
            return parts[0][np.argsort(order)]
        out = np.empty((len(texts), parts[0].shape[1]), dtype=np.float32)
        out[order] = np.concatenate(parts)
        return out

    def _token_lengths(self, texts: list[str]) -> list[int]:
        # The lengths the model will see (special tokens, truncation); a fast tokenizer does a batch in well under
        # a millisecond, next to tens of milliseconds of compute.
        ids = self.model.tokenizer(texts, truncation=True, max_length=self.model.max_seq_length)["input_ids"]
        return [len(x) for x in ids]

    def _pass_overhead(self) -> float:
        """A forward pass's fixed cost in padded tokens, measured (a/b of the fit) once passes of several sizes ran."""
        fit = self._pass_time.coefficients()
        if fit is None or fit[0] <= 0.0 or fit[1] <= 0.0:
            return DEFAULT_PASS_OVERHEAD_TOKENS
        return min(max(fit[0] / fit[1], PASS_OVERHEAD_RANGE[0]), PASS_OVERHEAD_RANGE[1])

    def _encode_with(self, model: Any, texts: list[str]) -> np.ndarray:
        import torch

        # As a tensor: numpy has no bfloat16, the vectors leave as float32 whatever the base computes in.
        with torch.inference_mode():
            emb = model.encode(
                texts, batch_size=max(len(texts), 1), convert_to_tensor=True,
                normalize_embeddings=self._normalize_in_encode, show_progress_bar=False,
            )
            return self._to_numpy(emb)

    def _to_numpy(self, emb: Any) -> np.ndarray:
        """float32 vectors; normalised ones computed in bf16/fp16 are normalised again in float32 (a 16-bit
        float keeps their length only to ~1e-3)."""
        import torch

        reduced = emb.dtype in (torch.bfloat16, torch.float16)
        emb = emb.float()
        if reduced and self.normalized and emb.numel():
            emb = torch.nn.functional.normalize(emb, p=2, dim=-1)
        return np.asarray(emb.cpu().numpy(), dtype=np.float32)

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
        if adapter_id is not None and adapter_id not in self._adapters:
            raise KeyError(f"adapter {adapter_id!r} is not loaded on base {self.spec.name!r}")
        if not self._adapters or adapter_id in self._unmixable:
            self._activate(adapter_id)
            return self._raw_encode(texts)
        # Named rows, not set_adapter / disable_adapters: those walk every module of every loaded adapter
        # (with 384 adapters loaded a switch cost 4x the batch itself).
        return self._named_rows(texts, [adapter_id] * len(texts))

    def encode_mixed(self, texts: list[str], adapters: Sequence[str | None]) -> np.ndarray:
        check_row_adapters(len(texts), "texts", adapters, self._adapters, self.spec.name)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        if len(set(adapters)) == 1:
            return self.encode(texts, adapters[0])
        if self._unmixable.intersection(adapters):
            return super().encode_mixed(texts, adapters)  # one pass per adapter, as the default does
        return self._named_rows(texts, adapters)

    def _named_rows(self, texts: list[str], adapters: Sequence[str | None]) -> np.ndarray:
        """One forward pass in which each LoRA layer applies row i's adapter to row i only (peft's mixed-batch
        forward; the bare base for None)."""
        import torch
        from sentence_transformers.util import batch_to_device

        if self._state is None or not self._state[0]:
            # Disabled LoRA layers ignore adapter_names; which adapter is active does not matter here. Enabled
            # once: nothing on this path disables them again.
            self.model.enable_adapters()
            self._state = (True, None)
        model = self.model
        prompt = model.prompts.get(model.default_prompt_name) if model.default_prompt_name else None
        # No model.encode: it sorts rows by length, and the adapter names must follow the rows.
        features = batch_to_device(model.preprocess(texts, prompt=prompt), model.device)
        rows = self._slots.grouped(adapters) if not self._aux_modules() and self._slots.groupable(adapters) else \
            self._adapter_names([BASE_ROW if a is None else a for a in adapters])
        with rows, torch.inference_mode():
            emb = model(features)["sentence_embedding"]
            if model.truncate_dim is not None:
                emb = emb[:, :model.truncate_dim]
            if self._normalize_in_encode:
                emb = torch.nn.functional.normalize(emb, p=2, dim=1)
            return self._to_numpy(emb)

    def _aux_modules(self) -> bool:
        """Whether some adapter brought modules_to_save wrappers (only peft's own mixed forward handles them)."""
        from peft.tuners.lora import LoraLayer

        if self._lora_modules is None:
            self._adapter_modules()
        return any(not isinstance(m, LoraLayer) for m in self._lora_modules or [])

    def _adapter_modules(self) -> list[Any]:
        from peft.tuners.lora import LoraLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        if self._lora_modules is None:  # walking the whole model costs about a millisecond: once per adapter set
            kinds = (LoraLayer, AuxiliaryTrainingWrapper)
            self._lora_modules = [m for m in self.model.modules() if isinstance(m, kinds)]
        return self._lora_modules

    def _adapter_names(self, names: list[str]) -> AbstractContextManager[None]:
        from lorafleet.sidecar.st_lora import named_rows

        return named_rows(self._adapter_modules(), names)

    def _refuse_on_int8(self, adapter_id: str) -> None:
        if self.precision == "int8":  # peft's LoRA layers wrap nn.Linear; quantisation replaced those
            raise AdapterUnavailable(f"adapter {adapter_id!r}: base {self.spec.name!r} is served at int8 (dynamic "
                                     "quantisation), which takes no LoRA adapters; serve it at fp32 or bf16")

    def load_adapter(self, adapter_id: str, path: str) -> None:
        self._refuse_on_int8(adapter_id)
        config = Path(path) / "adapter_config.json"
        try:
            recorded = json.loads(config.read_text()).get("base_model_name_or_path")
        except (OSError, ValueError) as exc:
            raise AdapterUnavailable(f"adapter {adapter_id!r}: cannot read {config}: {exc}") from exc
        # The recorded base is wherever training ran; we load the weights onto our own base instead.
        log.info("loading adapter %s from %s onto base %s (trained on %s)", adapter_id, path, self.spec.name, recorded)
        if not self._add_plain(adapter_id, self.read_adapter(adapter_id, path)):
            self._load(adapter_id, path, peft_model_id=path)

    def read_adapter(self, adapter_id: str, path: str) -> AdapterWeights:
        from peft import PeftConfig
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        folder = Path(path)
        try:
            config = PeftConfig.from_pretrained(str(folder))
            if (folder / "adapter_model.safetensors").exists():
                tensors = load_file(str(folder / "adapter_model.safetensors"))
            else:  # peft's older format
                import torch

                tensors = torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
        except (OSError, ValueError, TypeError, KeyError, RuntimeError, SafetensorError, UnpicklingError) as exc:
            # Missing or corrupt files: the folder would not load from disk either.
            raise AdapterUnavailable(f"adapter {adapter_id!r}: cannot read {path}: {exc}") from exc
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return AdapterWeights(path=str(folder), nbytes=nbytes, config=config, tensors=tensors)

    def load_adapter_weights(self, adapter_id: str, weights: AdapterWeights) -> None:
        self._refuse_on_int8(adapter_id)
        log.info("loading adapter %s from host memory (read from %s) onto base %s", adapter_id, weights.path,
                 self.spec.name)
        # On a CUDA device the layers get copies; on CPU they may share these tensors (inference never writes them).
        if not self._add_plain(adapter_id, weights):
            self._load(adapter_id, weights.path, peft_config=copy.deepcopy(weights.config),
                       adapter_state_dict=dict(weights.tensors))

    def _add_plain(self, adapter_id: str, weights: AdapterWeights) -> bool:
        """The constant-time path (st_lora.py) for a plain LoRA adapter like those loaded; False: not for it."""
        targets = self._slots.targets(weights.config, weights.tensors)
        if targets is None or adapter_id in self._adapters:
            return False
        try:  # neither enables, disables nor activates anything: the cached state (_state) stays true
            self._slots.add(adapter_id, weights.config, weights.tensors, targets)
        except _UNFIT as exc:
            raise AdapterUnavailable(f"adapter {adapter_id!r} from {weights.path} does not fit base "
                                     f"{self.spec.name!r}: {exc}") from exc
        self._adapters.append(adapter_id)
        return True

    def _load(self, adapter_id: str, path: str, **source: Any) -> None:
        try:
            with warnings.catch_warnings():
                # peft warns on every second adapter; several adapters on one base is the point here.
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                self.model.load_adapter(adapter_name=adapter_id, hotswap=False, **source)
        except _UNFIT as exc:
            self._forget_partial(adapter_id)
            msg = f"adapter {adapter_id!r} from {path} does not fit base {self.spec.name!r}: {exc}"
            raise AdapterUnavailable(msg) from exc
        except BaseException:
            self._forget_partial(adapter_id)
            raise
        finally:
            self._state = None
            self._lora_modules = None
            self._slots.forget()
        self._adapters.append(adapter_id)
        config = self.model.transformers_model.peft_config[adapter_id]
        # Only LoRA layers take adapter_names (others would apply the active adapter to every row), and peft
        # refuses them for DoRA.
        if getattr(config, "peft_type", None) != "LORA" or getattr(config, "use_dora", False):
            self._unmixable.add(adapter_id)

    def _forget_partial(self, adapter_id: str) -> None:
        # A failed load can leave the adapter half-registered in peft; remove it so a retry starts clean.
        try:
            self.model.delete_adapter(adapter_id)
        except Exception:
            log.debug("no partial adapter %s to remove", adapter_id)

    def unload_adapter(self, adapter_id: str) -> None:
        if adapter_id not in self._adapters:
            return
        if not self._slots.remove(adapter_id):
            self.model.delete_adapter(adapter_id)
            self._lora_modules = None
            self._slots.forget()
            self._state = None
        elif self._state is not None and self._state[1] == adapter_id:
            self._state = None  # peft made another adapter active in its place
        self._adapters.remove(adapter_id)
        self._unmixable.discard(adapter_id)

    def loaded_adapters(self) -> list[str]:
        return list(self._adapters)

    def close(self) -> None:
        self._adapters.clear()
        self._unmixable.clear()
        del self.model
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
