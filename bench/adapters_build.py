"""Random LoRA adapters for the adapter benchmark, built once into a cache folder and reused across runs.

One adapter is made with peft (r=8 on query and value, `init_lora_weights=False`, so it changes the
embeddings); every other one is a copy whose tensors are perturbed with numpy and written with
safetensors directly: 1,000 adapters take seconds, not the minutes 1,000 peft models would.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from lorafleet.core import settings

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
RANK = 8


def default_cache_dir(base_model: str) -> Path:
    """`$XDG_CACHE_HOME|~/.cache` / lorafleet/bench/adapters/<base>-r8 (inside `LORAFLEET_HOME` when that is set):
    a rebuildable cache shared by every run on this host, never the user's state."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(base_model).name)
    if os.environ.get("LORAFLEET_HOME"):
        root = settings.home() / "bench"
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lorafleet" / "bench"
    return root / "adapters" / f"{safe}-r{RANK}"


def adapter_name(i: int) -> str:
    return f"a{i:04d}"


def build_adapters(base_model: str | Path, cache_dir: Path, count: int, seed: int = 0) -> list[Path]:
    """Folders of adapters a0000 … a{count-1} under `cache_dir`, building those that are missing."""
    from lorafleet.testing import make_random_adapter

    cache_dir.mkdir(parents=True, exist_ok=True)
    first = cache_dir / adapter_name(0)
    if not (first / WEIGHTS).is_file():
        tmp = cache_dir / f".{adapter_name(0)}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        make_random_adapter(base_model, tmp, seed=seed, r=RANK)
        tmp.replace(first)
    paths = [first]
    missing = [i for i in range(1, count) if not (cache_dir / adapter_name(i) / WEIGHTS).is_file()]
    if missing:
        _perturb_copies(first, cache_dir, missing, seed)
    paths += [cache_dir / adapter_name(i) for i in range(1, count)]
    return paths


def _perturb_copies(first: Path, cache_dir: Path, indices: list[int], seed: int) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(first / WEIGHTS))
    config = (first / CONFIG).read_text()
    for i in indices:
        rng = np.random.default_rng(seed * 1_000_003 + i)
        # Each tensor scaled by its own factor and jittered: distinct adapters of the same shape and magnitude.
        out = {k: (v * rng.uniform(0.5, 1.5) + rng.normal(0.0, float(np.std(v)) * 0.5, v.shape)).astype(v.dtype)
               for k, v in tensors.items()}
        tmp = cache_dir / f".{adapter_name(i)}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(out, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(config)
        tmp.replace(cache_dir / adapter_name(i))


def adapter_bytes(path: Path) -> int:
    """Bytes of the adapter's weights (what a worker's adapter cache counts)."""
    return (path / WEIGHTS).stat().st_size


def describe(path: Path) -> dict[str, object]:
    cfg = json.loads((path / CONFIG).read_text())
    return {"r": cfg.get("r"), "lora_alpha": cfg.get("lora_alpha"), "target_modules": sorted(cfg.get("target_modules")
            or []), "weights_bytes": adapter_bytes(path)}
