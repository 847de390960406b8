"""Loading causal-LM bases for the generative task kind: with or without an adapter, with a chat template.

Where a base comes from (the packaged SmolLM2 GGUF, a .gguf, a folder, a hub id) and the one-time
GGUF → safetensors conversion are core (lorafleet.models.causal), shared with the serving runtimes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lorafleet.models.causal import (
    BASE_INFO_FILE,
    PACKAGED_GGUF,
    PACKAGED_SMOLLM2,
    CausalLMError,
    base_identity,
    convert_gguf,
    describe_base,
    file_sha256,
    find_gguf,
    gguf_cache_dir,
    gguf_metadata,
    packaged_gguf,
    resolve_causal_source,
)

log = logging.getLogger("lorafleet.train")


# ---------------------------------------------------------------- loading


def resolve_dtype(device: str, dtype: str | Any = "auto") -> Any:
    """A torch dtype: bf16 only on a CUDA device that supports it ('auto'), float32 otherwise."""
    import torch

    from lorafleet.models.device import bf16_supported

    if not isinstance(dtype, str):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if bf16_supported(device) else torch.float32
    if dtype not in {"float32", "bfloat16", "float16"}:
        raise CausalLMError(f"dtype {dtype!r} is not one of auto, float32, bfloat16, float16")
    return getattr(torch, dtype)


def check_causal_config(where: Path | str) -> Any:
    """The model config at `where`, or a CausalLMError if it is not a decoder-only causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(str(where))
    except (OSError, ValueError) as exc:
        raise CausalLMError(f"cannot read a model config at {where}: {exc}") from exc
    heads = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    allowed = set(heads) if isinstance(heads, (list, tuple)) else {heads} if heads else set()
    archs = list(getattr(config, "architectures", None) or [])
    # A BERT folder has a causal-LM class in the mapping (BertLMHeadModel) but was saved as an encoder.
    if not allowed or getattr(config, "is_encoder_decoder", False) or (archs and not set(archs) & allowed):
        raise CausalLMError(f"{where} is not a causal LM (model type {config.model_type!r}, architectures {archs}); "
                            "a generative task needs a decoder-only model such as SmolLM2-135M-Instruct")
    return config


def load_causal_tokenizer(source: str | Path, chat_template: str | None = None) -> Any:
    """The base's tokenizer with a chat template (`chat_template` replaces its own) and a pad token."""
    from transformers import AutoTokenizer

    where = resolve_causal_source(source)
    check_causal_config(where)  # before the tokenizer: "not a causal LM" is the first thing to fix
    tokenizer = AutoTokenizer.from_pretrained(str(where))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if not tokenizer.chat_template:
        raise CausalLMError(f"the tokenizer of {source} has no chat template; set train.chat_template "
                            "(a Jinja template that renders system, user and assistant messages)")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_base(
    source: str | Path, device: str = "cpu", dtype: str | Any = "auto", *, chat_template: str | None = None
) -> tuple[Any, Any]:
    """(model in eval mode on `device`, tokenizer) for a base causal LM."""
    from transformers import AutoModelForCausalLM

    where = resolve_causal_source(source)
    check_causal_config(where)
    tokenizer = load_causal_tokenizer(source, chat_template)
    model = AutoModelForCausalLM.from_pretrained(str(where), dtype=resolve_dtype(device, dtype))
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    model.eval()
    return model, tokenizer


def load_causal_adapter(
    source: str | Path,
    adapter_dir: str | Path,
    device: str = "cpu",
    dtype: str | Any = "auto",
    *,
    chat_template: str | None = None,
) -> tuple[Any, Any]:
    """A fresh base from `source` with the peft adapter in `adapter_dir` loaded and active.

    The base comes from `source`, never from `base_model_name_or_path` in adapter_config.json (an absolute
    path on the machine that trained it).
    """
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter_dir} is not a peft adapter directory (no adapter_config.json)")
    model, tokenizer = load_causal_base(source, device, dtype, chat_template=chat_template)
    model.load_adapter(str(adapter_dir))
    model.eval()
    return model, tokenizer


__all__ = [
    "BASE_INFO_FILE", "PACKAGED_GGUF", "PACKAGED_SMOLLM2", "CausalLMError", "base_identity", "check_causal_config",
    "convert_gguf", "describe_base", "file_sha256", "find_gguf", "gguf_cache_dir", "gguf_metadata",
    "load_causal_adapter", "load_causal_base", "load_causal_tokenizer", "packaged_gguf", "resolve_causal_source",
    "resolve_dtype",
]
