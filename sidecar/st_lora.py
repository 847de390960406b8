"""Adding and removing a LoRA adapter in time that does not grow with the adapters already loaded.

transformers' `load_adapter` / `delete_adapter` (and peft's `inject_adapter_in_model`) walk every module of
the model, the LoRA sub-modules of every loaded adapter included, and check the whole state dict: on MiniLM
each loaded adapter added about 1.65 ms to the next load (a cold load with 1,000 loaded would take ~1.7 s).
Once a first adapter has put LoRA layers on the model, a plain LoRA adapter with the same targets only needs a
new pair of matrices in each of those layers: `LoraSlots` does that through peft's own `update_layer` and
`delete_adapter` of each layer, and registers the config where transformers keeps it. Anything else (DoRA,
rank or alpha patterns, other targets, unexpected keys) returns None and the caller takes the general path.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from torch import nn

BASE_ROW = "__base__"  # peft's name for a row on the bare base in a mixed batch
# peft saves a LoRA layer's matrices under these names, relative to the wrapped model.
_PREFIX = "base_model.model."
# What a LoRA layer keeps per adapter (peft 0.21); `add` refuses to run when a layer keeps anything else.
_ENTRIES = {"r", "lora_alpha", "scaling", "use_rslora", "use_dora", "lora_bias", "lora_dropout", "lora_A", "lora_B"}


def _frozen_linear(weight: torch.Tensor, like: torch.Tensor) -> nn.Linear:
    """A bias-free Linear holding `weight` (out × in) on the device of `like`: in float32 on a float32 base, in its
    saved dtype on a reduced-precision base (bf16, fp16: the update is computed at the base's precision, and the
    adapter is not rounded twice). On the same device and dtype it shares the tensor: the host tier's copy is not
    duplicated, and inference never writes it."""
    dtype = like.dtype if like.dtype == torch.float32 else weight.dtype
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight.to(device=like.device, dtype=dtype), requires_grad=False)
    return layer


def _plain(config: Any) -> bool:
    return (type(config) is LoraConfig and not config.use_dora and not config.rank_pattern
            and not config.alpha_pattern and not config.lora_bias and config.layers_to_transform is None
            and not config.modules_to_save and not isinstance(config.target_modules, str)
            and not config.exclude_modules and config.target_parameters is None)


class LoraSlots:
    """The LoRA layers of one model (`transformers_model` of a SentenceTransformer) by module name."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._layers: dict[str, LoraLayer] | None = None

    def layers(self) -> dict[str, LoraLayer]:
        if self._layers is None:
            self._layers = {name: m for name, m in self.model.named_modules() if isinstance(m, LoraLayer)}
        return self._layers

    def forget(self) -> None:
        """The model's LoRA layers changed by another path (a general load or delete): find them again."""
        self._layers = None

    def targets(self, config: Any, tensors: dict[str, torch.Tensor]) -> dict[str, LoraLayer] | None:
        """The layers the adapter fills, when it can be added here; None: take the general path."""
        if not getattr(self.model, "_hf_peft_config_loaded", False) or not _plain(config):
            return None
        names = set(config.target_modules)
        found = {n: layer for n, layer in self.layers().items() if n.rsplit(".", 1)[-1] in names}
        if not found:
            return None
        expected = {f"{_PREFIX}{n}.lora_{ab}.weight" for n in found for ab in "AB"}
        if set(tensors) != expected or not all(self._entries_match(layer) for layer in found.values()):
            return None
        for n, layer in found.items():
            a, b = tensors[f"{_PREFIX}{n}.lora_A.weight"], tensors[f"{_PREFIX}{n}.lora_B.weight"]
            if tuple(a.shape) != (config.r, layer.in_features) or tuple(b.shape) != (layer.out_features, config.r):
                return None
        return found

    def add(self, adapter_id: str, config: Any, tensors: dict[str, torch.Tensor],
            targets: dict[str, LoraLayer]) -> None:
        """Put the adapter in `targets` (from `targets()`); on failure nothing of it stays.

        The per-adapter entries are written directly rather than through `LoraLayer.update_layer`, whose
        `set_adapter` and device move visit every loaded adapter's parameters (O(adapters) per layer)."""
        config = copy.copy(config)
        config.inference_mode = True
        scaling = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
        done: list[LoraLayer] = []
        try:
            with torch.no_grad():
                for name, layer in targets.items():
                    weight = layer.get_base_layer().weight
                    a, b = (tensors[f"{_PREFIX}{name}.lora_{ab}.weight"] for ab in "AB")
                    done.append(layer)
                    layer.r[adapter_id] = config.r
                    layer.lora_alpha[adapter_id] = config.lora_alpha
                    layer.scaling[adapter_id] = scaling
                    layer.use_rslora[adapter_id] = config.use_rslora
                    layer.use_dora[adapter_id] = False
                    layer.lora_bias[adapter_id] = False
                    layer.lora_dropout[adapter_id] = nn.Identity()  # inference: dropout is the identity
                    layer.lora_A[adapter_id] = _frozen_linear(a, weight)
                    layer.lora_B[adapter_id] = _frozen_linear(b, weight)
            self.model.peft_config[adapter_id] = config
        except BaseException:
            for layer in done:
                layer.delete_adapter(adapter_id)
            raise

    def _entries_match(self, layer: LoraLayer) -> bool:
        """Whether `add` writes every per-adapter entry this peft version keeps (checked on a loaded adapter)."""
        ref = next(iter(layer.lora_A), None)
        if ref is None:
            return False
        held = {k for k, v in {**vars(layer), **layer._modules}.items()
                if k != "_active_adapter" and isinstance(v, dict | nn.ModuleDict) and ref in v}
        return held == _ENTRIES

    def remove(self, adapter_id: str) -> bool:
        """Delete the adapter from every layer; False when the general path must do it (the last adapter:
        transformers then takes its LoRA bookkeeping off the model)."""
        peft_config = getattr(self.model, "peft_config", {})
        if adapter_id not in peft_config or len(peft_config) < 2:
            return False
        for layer in self.layers().values():
            layer.delete_adapter(adapter_id)
        del peft_config[adapter_id]
        return True

    def groupable(self, adapters: Sequence[str | None]) -> bool:
        """Whether `grouped` can compute these rows: plain LoRA adapters of one rank."""
        peft_config = getattr(self.model, "peft_config", {})
        ranks = {peft_config[a].r if a in peft_config and _plain(peft_config[a]) else -1
                 for a in set(adapters) if a is not None}
        return len(ranks) == 1 and -1 not in ranks

    @contextmanager
    def grouped(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Row i gets adapter i's update (None: none) in a fixed number of tensor ops per layer, whatever the number
        of distinct adapters: peft's mixed-batch forward runs a gather, two matmuls and a scatter per adapter per
        layer, which in a batch of 16 rows over 16 adapters cost more than the base layers themselves on a CPU.
        Each layer computes only its base output (every row named the bare base), and a forward hook adds the
        LoRA updates of all rows at once with batched matmuls over the rows' stacked A and B matrices."""
        rows = [i for i, a in enumerate(adapters) if a is not None]
        names = list(adapters)
        handles = []
        try:
            for layer in self.layers().values():
                handles.append(layer.register_forward_pre_hook(partial(_bare_rows, n=len(names)), with_kwargs=True))
                handles.append(layer.register_forward_hook(partial(_add_updates, rows=rows, names=names),
                                                           with_kwargs=True))
            yield
        finally:
            for handle in handles:
                handle.remove()


@contextmanager
def named_rows(modules: Iterable[Any], names: list[str]) -> Iterator[None]:
    """Pass `adapter_names` (row i's adapter, BASE_ROW for the bare base) to each module's forward, as peft's
    `_enable_peft_forward_hooks` does: peft's LoRA layers and modules_to_save wrappers then apply row i's adapter to
    row i only (its mixed-batch forward). The modules must have their adapters enabled."""
    def inject(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        kwargs["adapter_names"] = names
        return args, kwargs

    handles = []
    try:
        for module in modules:
            handles.append(module.register_forward_pre_hook(inject, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _bare_rows(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> tuple[Any, Any]:
    kwargs["adapter_names"] = [BASE_ROW] * n
    return args, kwargs


def _add_updates(layer: LoraLayer, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor,
                 rows: list[int], names: list[str | None]) -> torch.Tensor:
    mine = [i for i in rows if names[i] in layer.lora_A]
    if not mine:
        return output
    x = args[0] if args else kwargs["x"]
    ids = [names[i] for i in mine]
    # Computed at the base's precision (its output's dtype): adapters kept in their saved dtype are cast per batch
    # (the stack copies them anyway).
    dtype = output.dtype
    a = torch.stack([layer.lora_A[n].weight for n in ids]).to(dtype)  # rows × r × in
    b = torch.stack([layer.lora_B[n].weight for n in ids]).to(dtype)  # rows × out × r
    index = torch.tensor(mine, device=x.device)
    sub = x.index_select(0, index).to(dtype)
    flat = sub.reshape(len(mine), -1, sub.shape[-1])  # rows × tokens × in
    scale = torch.tensor([layer.scaling[n] for n in ids], dtype=dtype, device=a.device).view(-1, 1, 1)
    update = torch.bmm(torch.bmm(flat, a.transpose(1, 2)), b.transpose(1, 2)) * scale
    return output.index_add(0, index, update.reshape(*sub.shape[:-1], -1))
