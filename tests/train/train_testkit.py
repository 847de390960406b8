"""Checks of what every kind's training does alike (the one loop), and the tiny generation config two tests share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

GEN_SYSTEM = "Überschrift des Paragraphen."
GEN_LAWS = ["kschg", "prodhaftg", "tzbfg", "agg"]


def check_epoch_exception_propagates(train: Callable[[Callable[[int, dict[str, float]], None]], Any],
                                     out_dir: Path) -> None:
    """What `on_epoch` raises after epoch 1 (a pruned trial) leaves `train(on_epoch)`, and no adapter is saved."""

    class Prune(Exception):
        pass

    seen: list[int] = []

    def on_epoch(epoch: int, metrics: dict[str, float]) -> None:
        seen.append(epoch)
        raise Prune(f"epoch {epoch}")

    with pytest.raises(Prune, match="epoch 1"):
        train(on_epoch)
    assert seen == [1]
    assert not (out_dir / "adapter").exists()


def tiny_generation_cfg(model: Path, **kw: Any) -> Any:
    """A generation config for a tiny llama on four small laws: 3 epochs of short inputs and answers."""
    from lorafleet.train.kinds.generation.headings import HeadingsDataConfig
    from lorafleet.train.kinds.generation.trainer import GenerationLoraSettings, GenerationTrainConfig

    base: dict[str, Any] = dict(
        base_model=str(model),
        data=HeadingsDataConfig(laws=GEN_LAWS, input_max_tokens=32, system_prompt=GEN_SYSTEM, dev_fraction=0.15,
                                test_fraction=0.15, max_eval_examples=12),
        lora=GenerationLoraSettings(r=8, alpha=16), learning_rate=5e-3, epochs=3, batch_size=8, warmup_ratio=0.0,
        max_length=96, device="cpu", eval_batch_size=12, max_new_tokens=6,
    )
    base.update(kw)
    return GenerationTrainConfig(**base)
