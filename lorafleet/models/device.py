"""Which torch device a setting means: one rule for training, evaluation and serving."""

from __future__ import annotations

from pathlib import Path

from lorafleet.core.config import ConfigError

_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def resolve_device(device: str) -> str:
    """'auto' → 'cuda' when a CUDA device is present, else 'cpu'; an explicit CUDA device must exist."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but no CUDA device is available; use 'auto' or 'cpu'")
    return device


def bf16_supported(device: str) -> bool:
    """Whether training on `device` can use bfloat16 mixed precision (CUDA with bf16 support)."""
    import torch

    return device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def nvidia_gpu_present(gpus: Path = _NVIDIA_GPUS) -> bool:
    """Whether the NVIDIA driver lists a GPU on this host (without importing torch: `lorafleet up` asks)."""
    try:
        return any(gpus.iterdir())
    except OSError:
        return False
