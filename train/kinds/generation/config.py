"""The `train:` section of a generative task: `GenerationTrainConfig`, and reading it from a YAML file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from lorafleet.core.config import ConfigError, StrictModel, apply_overrides, read_yaml, validate_model
from lorafleet.train.dropout import DROPOUT_MASKS_HELP, DropoutMasks
from lorafleet.train.kinds.generation.byo import GenerationDatasetData
from lorafleet.train.kinds.generation.causal_lm import PACKAGED_SMOLLM2
from lorafleet.train.kinds.generation.headings import HeadingsDataConfig
from lorafleet.train.precision import PRECISION_HELP, TrainPrecision


def _data_kind(value: Any) -> str:
    layout = value.get("layout") if isinstance(value, dict) else getattr(value, "layout", None)
    return "dataset" if layout is not None else "headings"


GenerationData = Annotated[
    Annotated[HeadingsDataConfig, Tag("headings")] | Annotated[GenerationDatasetData, Tag("dataset")],
    Discriminator(_data_kind),
]


class GenerationLoraSettings(StrictModel):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (lora_alpha).")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"], min_length=1,
        description="Module names (peft matches suffixes), or ['all-linear']: every linear layer but the LM head.",
    )


class GenerationBaselineSettings(StrictModel):
    """The prompted baselines a specialist must beat (beside the lead words and the bare base)."""

    kshot: int = Field(4, ge=0, le=64, description="Training examples in the k-shot prompt (prior turns); 0: none.")
    other_model: str | None = Field(
        "auto", description="The k-shot prompt on another base: 'auto' is the other packaged one "
        "(SmolLM2-135M-Instruct <-> gemma-3-270m; none for other bases), a model source, or null for none.")
    cache: bool = Field(
        True, description="Reuse the baselines of an earlier run on this LORAFLEET_HOME with the same dataset digest, "
        "the same base weights (by content digest), decoding settings and library versions; false recomputes them. "
        "A hub-id base is never reused (its weights can change upstream).")


class GenerationTrainConfig(StrictModel):
    """The `train:` section of a generative (headings) task."""

    base_model: str = Field(PACKAGED_SMOLLM2, description="Packaged SmolLM2-135M-Instruct or gemma-3-270m (GGUF), "
                            "local folder or .gguf, hub id.")
    chat_template: str | None = Field(None, description="Jinja chat template, for a tokenizer that lacks one.")
    data: GenerationData = Field(default_factory=HeadingsDataConfig, description="The statute headings (default), "
                                 "or your own rows with `layout: messages | prompt_completion` (docs/data.md).")
    lora: GenerationLoraSettings = Field(default_factory=GenerationLoraSettings)
    baselines: GenerationBaselineSettings = Field(default_factory=GenerationBaselineSettings)
    learning_rate: float = Field(2e-3, gt=0, lt=1)
    epochs: int = Field(1, ge=1, le=100)
    batch_size: int = Field(8, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    lr_scheduler: Literal["linear", "cosine", "constant_with_warmup"] = Field(
        "linear", description="Learning-rate schedule after the warm-up.")
    weight_decay: float = Field(0.0, ge=0)
    max_length: int = Field(256, ge=16, description="Token cap of one training sequence (prompt + heading).")
    packing: bool = Field(False, description="Pack sequences (trl BFD, padding-free) instead of padding a batch.")
    group_by_length: bool = Field(True, description="Batch similar lengths together (less padding).")
    activation_checkpointing: bool = Field(False, description="Trade compute for memory (trl turns it on by default).")
    seed: int = 42
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda', 'cuda:0', …")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="The dtype the base's weights are loaded in, for training and evaluation alike (auto: "
        "bfloat16 on a CUDA GPU that supports it, else float32). Weights in bfloat16 also train in bfloat16. "
        "Compare `precision`, which keeps float32 weights and computes in bf16.")
    precision: TrainPrecision = Field("fp32", description=PRECISION_HELP)
    dropout_masks: DropoutMasks = Field("fast", description=DROPOUT_MASKS_HELP)
    eval_batch_size: int = Field(16, ge=1)
    max_new_tokens: int = Field(32, ge=1, description="Cap of a generated heading (98 % of headings fit in 32).")
    price_per_hour_usd: float = Field(0.10, ge=0, description="Machine price, for the run's estimated cost.")


def load_generation_config(path: str | Path, overrides: list[str] | None = None) -> GenerationTrainConfig:
    """Read the `train:` section of `path`; `overrides` are `key=value` relative to it (`lora.r=16`)."""
    path = Path(path)
    raw = read_yaml(path)
    if not isinstance(raw, dict) or not isinstance(raw.get("train"), dict):
        raise ConfigError(f"{path} has no top-level 'train:' mapping")
    section = apply_overrides(raw["train"], list(overrides or []))
    return validate_model(GenerationTrainConfig, section, source=f"{path} [train]")
