"""Training precision for every kind: what `train.precision` resolves to, and float32 evaluation under autocast."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from lorafleet.core.config import ConfigError

TrainPrecision = Literal["auto", "fp32", "bf16"]
PRECISION_HELP = (
    "Compute precision of training: 'bf16' autocasts the forward pass to bfloat16 while the weights, the LoRA "
    "adapter and the optimizer stay float32 (mixed precision, as transformers' `bf16=True`); 'fp32' computes "
    "in float32; 'auto' is bf16 where the device computes it natively (CPU flags avx512_bf16 or amx_bf16, ARM "
    "bf16, or a CUDA GPU with bf16), else fp32. bf16 on a device without it is a config error. Evaluation "
    "(dev, test, baselines) always runs at float32, so the scores compare across precisions."
)


def resolve_training_precision(precision: str, device: str, *, cpuinfo: str | None = None,
                               field: str = "train.precision") -> str:
    """'fp32' or 'bf16': what training at `precision` computes in on `device` (a resolved device, 'cpu' or
    'cuda…'). ConfigError when bf16 is asked of a device that does not compute it natively (on a CPU without
    it, bf16 runs emulated and slower than fp32), naming what is supported. `cpuinfo` defaults to this host's."""
    from lorafleet.models.precision import FP32, supported_precisions

    if precision == FP32:
        return FP32
    native = "bf16" in supported_precisions(device, cpuinfo)
    if precision == "auto":
        return "bf16" if native else FP32
    if precision != "bf16":
        raise ConfigError(f"{field} is {precision!r}; choose auto, fp32 or bf16")
    if not native:
        what = ("this GPU does not support bf16 (torch.cuda.is_bf16_supported() is False)" if device.startswith("cuda")
                else "this CPU has no native bf16 (no avx512_bf16 or amx_bf16 flag on x86, no bf16 feature on ARM), "
                "where bf16 runs emulated and slower than fp32")
        raise ConfigError(f"{field} is 'bf16', but {what}; supported on {device}: fp32 (or 'auto', which picks "
                          "bf16 only where it is native)")
    return "bf16"


@contextmanager
def float32_forward(model: Any) -> Iterator[Any]:
    """`model` with its own forward for the block: under mixed precision, accelerate wraps the trained module's
    `forward` in autocast on the instance (and leaves it there after training), so an evaluation that runs
    through it (sentence-transformers' `encode` does) would score at bf16; inside, it scores at float32."""
    wrapped, original = model.__dict__.get("forward"), model.__dict__.get("_original_forward")
    if wrapped is None or original is None:
        yield model
        return
    model.forward = original
    try:
        yield model
    finally:
        model.forward = wrapped


def drop_autocast(model: Any) -> None:
    """Undo accelerate's autocast wrapper on `model` for good (after training: the model is evaluated, saved
    and handed on at float32, as an fp32-trained one)."""
    original = model.__dict__.pop("_original_forward", None)
    if original is not None:
        model.__dict__.pop("forward", None)
