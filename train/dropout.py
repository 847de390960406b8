"""Dropout masks at a fraction of torch's cost on CPU: the training loop's largest single cost there.

Training a LoRA on CPU spends ~40 % of each step (fp32; ~55 % under bf16 autocast) drawing dropout masks
(MiniLM at batch 32: `aten::bernoulli_`, torch.profiler): torch draws every element from one serial
Mersenne Twister, ~10 ns an element. The forward pass has a dozen dropouts per layer (the base's hidden and
attention-output dropouts and one on the input of every LoRA module), each as large as the activations.

`FastDropout` draws the same Bernoulli(1 - p) keep mask from a counter-based hash instead (splitmix64 over
an index range, seeded by one draw from torch's generator): a few vectorised int64 ops per four mask
elements, 16 bits each, so p is exact to 2⁻¹⁶ and runs are reproducible under `torch.manual_seed`.
It is statistically a dropout, not bit-identical to torch's: the same seed gives another mask. On CUDA
torch's own dropout (Philox) is already fast, so only CPU training swaps it (`use_fast_dropout`).
Dropout inside `scaled_dot_product_attention` (attention probabilities) stays torch's: it is not a module
and is ~3 % of a step.
"""

from __future__ import annotations

import math
from typing import Any, Literal

DropoutMasks = Literal["fast", "torch"]
DROPOUT_MASKS_HELP = (
    "How training draws dropout masks on CPU: 'fast' (a counter-based hash, several times cheaper than torch's "
    "serial generator, which takes ~40 % of a CPU training step; the same p, another random stream) or 'torch' "
    "(torch's own nn.Dropout). CUDA always uses torch's. Seeded runs are reproducible either way."
)

# splitmix64's constants as signed int64 (torch has no uint64 arithmetic; products wrap the same way).
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _random_int16(n: int, seed: int) -> Any:
    """`n` uniformly distributed int16 values: splitmix64 of (index × golden + seed), four per word."""
    import torch

    z = torch.arange((n + 3) // 4, dtype=torch.int64).mul_(_GOLDEN).add_(seed)
    # Logical right shifts: torch shifts int64 arithmetically, so mask the sign bits back out.
    z ^= (z >> 30) & ((1 << 34) - 1)
    z.mul_(_MIX1)
    z ^= (z >> 27) & ((1 << 37) - 1)
    z.mul_(_MIX2)
    z ^= (z >> 31) & ((1 << 33) - 1)
    return z.view(torch.int16)[:n]


def keep_mask(shape: tuple[int, ...], p: float, generator: Any = None) -> tuple[Any, float]:
    """A boolean mask of `shape` that keeps each element with probability 1 - p (p rounded to 2⁻¹⁶), and
    that probability, exactly (the scale of the kept elements)."""
    import torch

    n = math.prod(shape)
    seed = int(torch.randint(-(2**62), 2**62, (1,), generator=generator))
    drop = round(p * 65536)
    return _random_int16(n, seed).view(shape) >= drop - 32768, 1.0 - drop / 65536


def _fast_dropout_class() -> type:
    import torch

    class FastDropout(torch.nn.Module):
        """nn.Dropout's contract (identity in eval mode, kept elements scaled by 1 / (1 - p)) with a cheap mask."""

        def __init__(self, p: float) -> None:
            super().__init__()
            if not 0.0 <= p < 1.0:
                raise ValueError(f"dropout probability must be in [0, 1), got {p}")
            self.p = p

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.training or self.p == 0.0:
                return x
            keep, kept = keep_mask(tuple(x.shape), self.p)
            return x * keep.to(x.dtype).mul_(1.0 / kept)

        def extra_repr(self) -> str:
            return f"p={self.p}"

    return FastDropout


_CLASS: type | None = None


def fast_dropout(p: float) -> Any:
    """A FastDropout module (the class is built on first use: torch is imported lazily here)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _fast_dropout_class()
    return _CLASS(p)


def use_fast_dropout(model: Any, device: str, masks: DropoutMasks = "fast") -> int:
    """Swap every torch `nn.Dropout` with p > 0 in `model` (the base's and the LoRA modules') for FastDropout,
    on CPU and when `masks` is 'fast'; returns how many were swapped."""
    import torch

    if masks != "fast" or not device.startswith("cpu"):
        return 0
    swaps = [(name, module) for name, module in model.named_modules()
             if type(module) is torch.nn.Dropout and module.p > 0]
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, fast_dropout(module.p))
    return len(swaps)
