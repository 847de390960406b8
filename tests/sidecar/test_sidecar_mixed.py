"""Mixed-adapter batches on the sentence-transformers runtime (tiny BERT): one forward pass over rows of several
adapters and the bare base equals one batch per adapter; adapters loaded from host memory equal those from disk."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from sidecar_testkit import make_adapter

from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.core.config import BaseModelSpec
from lorafleet.sidecar.runtime import AdapterWeights
from lorafleet.sidecar.st_runtime import SentenceTransformerRuntime

ADAPTERS = ["r1", "r2", "r3", "r4"]
WORDS = ["der", "käufer", "zahlt", "den", "preis", "und", "die", "ware", "kommt", "bald", "an", "fox", "dog", "quick"]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixed")
    return {name: make_adapter(tiny_model_dir, root / name, seed) for seed, name in enumerate(ADAPTERS, 11)}


@pytest.fixture(scope="module")
def rt(tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> SentenceTransformerRuntime:
    runtime = SentenceTransformerRuntime(BaseModelSpec(name="tiny", source=str(tiny_model_dir)), device="cpu")
    for name, path in adapter_dirs.items():
        runtime.load_adapter(name, str(path))
    return runtime


def rows(seed: int, n: int) -> tuple[list[str], list[str | None]]:
    """n texts of random lengths (so padding differs between a mixed batch and each adapter's own), each on a
    random adapter or the bare base, in random order."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(1, 24))) for _ in range(n)]
    adapters: list[str | None] = [[None, *ADAPTERS][i % 5] for i in range(n)]
    rng.shuffle(adapters)
    return texts, adapters


def per_adapter(rt: SentenceTransformerRuntime, texts: list[str], adapters: list[str | None]) -> np.ndarray:
    """The one-adapter-per-batch path: one `encode` per adapter, put back in row order."""
    out = np.zeros((len(texts), rt.dim), dtype=np.float32)
    for adapter in set(adapters):
        idx = [i for i, a in enumerate(adapters) if a == adapter]
        rt._activate(adapter)  # peft's own one-adapter forward (set_adapter / disable_adapters + model.encode)
        out[idx] = rt._raw_encode([texts[i] for i in idx])
    return out


def test_mixed_batch_equals_one_batch_per_adapter(rt: SentenceTransformerRuntime) -> None:
    assert rt.mixed_adapters
    for seed in (1, 2):
        texts, adapters = rows(seed, 23)
        mixed = rt.encode_mixed(texts, adapters)
        assert mixed.dtype == np.float32 and mixed.shape == (len(texts), rt.dim)
        separate = per_adapter(rt, texts, adapters)
        assert cosines(mixed, separate).min() > 0.9999
        # Each adapter really changes its rows, so a row on the wrong adapter (or on none) would fail above.
        bare = rt.encode(texts, None)
        on_adapter = [i for i, a in enumerate(adapters) if a is not None]
        assert cosines(mixed[on_adapter], bare[on_adapter]).max() < 0.9999
        # And rows stay in input order: the same rows reversed come back reversed.
        assert cosines(rt.encode_mixed(texts[::-1], adapters[::-1])[::-1], mixed).min() > 0.9999


def test_single_adapter_path_is_unchanged_after_mixed_calls(rt: SentenceTransformerRuntime) -> None:
    from peft.tuners.lora import LoraLayer

    texts, adapters = rows(3, 10)
    before = {a: rt.encode(texts, a) for a in [None, *ADAPTERS]}
    rt.encode(texts, None)  # adapters disabled: a mixed call must enable them, and encode disable them again
    rt.encode_mixed(texts, adapters)
    lora_layers = [m for m in rt.model.modules() if isinstance(m, LoraLayer)]
    assert lora_layers and not any(m._forward_pre_hooks for m in lora_layers)  # the adapter_names hooks are gone
    for a in [None, *ADAPTERS, None, "r2"]:
        assert cosines(rt.encode(texts, a), before[a]).min() > 0.9999, a
    # One distinct adapter (or the bare base only) takes the plain path and gives the same vectors.
    assert cosines(rt.encode_mixed(texts, ["r3"] * len(texts)), before["r3"]).min() > 0.9999
    assert cosines(rt.encode_mixed(texts, [None] * len(texts)), before[None]).min() > 0.9999


def test_unknown_adapter_and_bad_lengths_are_refused(rt: SentenceTransformerRuntime) -> None:
    with pytest.raises(KeyError, match="'nope'"):
        rt.encode_mixed(["a", "b", "c"], ["r1", "nope", None])
    with pytest.raises(ValueError, match="2 texts but 1 adapter"):
        rt.encode_mixed(["a", "b"], ["r1"])
    assert rt.encode_mixed([], []).shape == (0, rt.dim)


def test_adapters_from_host_memory_equal_those_from_disk(
        rt: SentenceTransformerRuntime, adapter_dirs: dict[str, Path]) -> None:
    texts, _ = rows(4, 8)
    weights = rt.read_adapter("h1", str(adapter_dirs["r1"]))
    assert isinstance(weights, AdapterWeights) and weights.path == str(adapter_dirs["r1"])
    from safetensors.torch import load_file

    on_disk = load_file(str(adapter_dirs["r1"] / "adapter_model.safetensors"))
    assert weights.nbytes == sum(t.numel() * t.element_size() for t in on_disk.values()) > 0
    for round_ in range(2):  # the same host copy loads again after an unload
        rt.load_adapter_weights("h1", weights)
        assert "h1" in rt.loaded_adapters()
        assert cosines(rt.encode(texts, "h1"), rt.encode(texts, "r1")).min() > 0.9999, round_
        mixed = rt.encode_mixed(texts + texts, ["h1"] * len(texts) + ["r1"] * len(texts))
        assert cosines(mixed[:len(texts)], mixed[len(texts):]).min() > 0.9999, round_
        rt.unload_adapter("h1")
    assert "h1" not in rt.loaded_adapters()


def test_unreadable_or_unfit_adapters_are_unavailable(
        rt: SentenceTransformerRuntime, adapter_dirs: dict[str, Path], tmp_path: Path) -> None:
    loaded = rt.loaded_adapters()
    with pytest.raises(AdapterUnavailable, match="cannot read"):
        rt.read_adapter("x", str(tmp_path))  # no adapter_config.json
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((adapter_dirs["r1"] / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(AdapterUnavailable, match="cannot read"):
        rt.read_adapter("y", str(bad))
    # A config that targets modules this base does not have: read fine, refused when loaded.
    unfit = tmp_path / "unfit"
    unfit.mkdir()
    config = json.loads((adapter_dirs["r1"] / "adapter_config.json").read_text())
    (unfit / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["nope"]}))
    (unfit / "adapter_model.safetensors").write_bytes((adapter_dirs["r1"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterUnavailable, match="does not fit"):
        rt.load_adapter_weights("z", rt.read_adapter("z", str(unfit)))
    assert rt.loaded_adapters() == loaded
    texts, adapters = rows(5, 6)
    assert rt.encode_mixed(texts, adapters).shape == (6, rt.dim)  # still serves


def test_adapters_peft_cannot_mix_fall_back_to_one_pass_each(
        rt: SentenceTransformerRuntime, tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(7)
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], init_lora_weights=False, use_dora=True)
    get_peft_model(model.transformers_model, config).save_pretrained(str(tmp_path / "dora"))
    rt.load_adapter("dora", str(tmp_path / "dora"))  # peft refuses adapter_names with DoRA
    try:
        texts, adapters = rows(6, 12)
        adapters = ["dora" if a == "r4" else a for a in adapters]
        assert cosines(rt.encode_mixed(texts, adapters), per_adapter(rt, texts, adapters)).min() > 0.9999
    finally:
        rt.unload_adapter("dora")
    texts, adapters = rows(7, 12)  # plain LoRA adapters mix again
    assert cosines(rt.encode_mixed(texts, adapters), per_adapter(rt, texts, adapters)).min() > 0.9999


def test_grouped_updates_equal_peft_mixed_forward(rt: SentenceTransformerRuntime) -> None:
    """The batched-matmul path (st_lora.LoraSlots.grouped) against peft's own mixed-batch forward."""
    texts, adapters = rows(7, 24)
    assert rt._slots.groupable(adapters)
    grouped = rt.encode_mixed(texts, adapters)
    with rt._adapter_names(["__base__" if a is None else a for a in adapters]):
        model = rt.model
        features = {k: v for k, v in model.preprocess(texts).items()}
        import torch

        with torch.inference_mode():
            peft_rows = model(features)["sentence_embedding"].numpy()
    assert cosines(grouped, peft_rows).min() > 0.9999
