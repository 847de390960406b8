"""Fast dropout masks for CPU training: the statistics of the mask, nn.Dropout's contract, reproducibility, and the
swap on a real (tiny) BERT with LoRA modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.train.dropout import fast_dropout, keep_mask, use_fast_dropout
from lorafleet.train.kinds.generation.config import GenerationTrainConfig
from lorafleet.train.kinds.rerank.config import RerankConfig
from lorafleet.train.kinds.retrieval.config import TrainConfig


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5])
def test_the_mask_keeps_one_minus_p_and_says_exactly_how_much(p: float) -> None:
    keep, kept = keep_mask((500, 400), p)
    assert keep.shape == (500, 400) and str(keep.dtype) == "torch.bool"
    assert abs(kept - (1 - p)) < 2**-16
    # 200,000 Bernoulli draws: the standard error is below 0.0012 at p = 0.5.
    assert abs(float(keep.float().mean()) - kept) < 0.005


def test_every_lane_of_a_word_is_unbiased_and_neighbours_are_independent() -> None:
    import torch

    keep, _ = keep_mask((200_000, 4), 0.5)  # four 16-bit lanes of one 64-bit word per row
    lane_means = keep.float().mean(0)
    assert torch.all((lane_means - 0.5).abs() < 0.01), lane_means
    flat = keep.flatten().float()
    neighbours = torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1]
    assert abs(float(neighbours)) < 0.01


def test_masks_follow_the_torch_seed_and_differ_between_calls() -> None:
    import torch

    torch.manual_seed(7)
    a, b = keep_mask((1000,), 0.3)[0], keep_mask((1000,), 0.3)[0]
    torch.manual_seed(7)
    assert torch.equal(keep_mask((1000,), 0.3)[0], a)
    assert not torch.equal(a, b)


def test_fast_dropout_keeps_nn_dropouts_contract() -> None:
    import torch

    d = fast_dropout(0.2)
    x = torch.ones(300, 200, requires_grad=True)
    y = d(x)
    kept = y.detach()[y.detach() != 0]
    assert torch.allclose(kept, torch.full_like(kept, 1 / 0.8))  # kept elements scaled by 1 / (1 - p)
    assert abs(float(y.detach().mean()) - 1.0) < 0.02  # the expectation is unchanged
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad == 0, y.detach() == 0)  # gradient flows through kept ones only
    d.eval()
    assert d(x) is x
    assert fast_dropout(0.0).train()(x) is x
    assert d(x.to(torch.bfloat16)).dtype == torch.bfloat16
    d.train()
    assert d(x.detach().to(torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        fast_dropout(1.0)


def test_the_swap_covers_the_base_and_the_lora_modules_on_cpu_only(tiny_model_dir: Path) -> None:
    import torch
    from peft import LoraConfig, TaskType
    from sentence_transformers import SentenceTransformer

    def model() -> SentenceTransformer:
        m = SentenceTransformer(str(tiny_model_dir), device="cpu")
        m.add_adapter(LoraConfig(task_type=TaskType.FEATURE_EXTRACTION, r=4, lora_alpha=8, lora_dropout=0.05,
                                 target_modules=["query", "value"]))
        return m

    def dropouts(m: SentenceTransformer) -> list[tuple[str, float]]:
        return [(n, mod.p) for n, mod in m.named_modules() if type(mod) is torch.nn.Dropout and mod.p > 0]

    m = model()
    before = dropouts(m)
    assert any("lora_dropout" in n for n, _ in before) and any("lora" not in n for n, _ in before)
    assert use_fast_dropout(m, "cuda") == 0 and use_fast_dropout(m, "cpu", "torch") == 0
    assert dropouts(m) == before
    m.eval()
    text = ["Der Arbeitgeber kündigt das Arbeitsverhältnis."]
    reference = m.encode(text, convert_to_tensor=True)
    assert use_fast_dropout(m, "cpu") == len(before)
    assert dropouts(m) == []
    swapped = {n: mod.p for n, mod in m.named_modules() if type(mod).__name__ == "FastDropout"}
    assert swapped == dict(before)  # same places, same p
    assert torch.equal(m.encode(text, convert_to_tensor=True), reference)  # eval mode: the same model
    m.train()
    features = m.tokenize(text * 4)
    out = m(features)["sentence_embedding"]
    out.sum().backward()  # trains through the swapped modules
    assert any(p.grad is not None for n, p in m.named_parameters() if "lora_" in n)


def test_every_training_kind_defaults_to_fast_masks() -> None:
    assert TrainConfig().dropout_masks == "fast"
    assert GenerationTrainConfig().dropout_masks == "fast"
    assert RerankConfig().dropout_masks == "fast"
    assert TrainConfig(dropout_masks="torch").dropout_masks == "torch"
    with pytest.raises(ValueError, match="dropout_masks"):
        TrainConfig(dropout_masks="philox")
