"""Constant-time adapter loads (sidecar/st_lora.py) on the tiny BERT: an adapter added beside others gives the
vectors it gives loaded alone through transformers' general path, and loads, unloads and reloads keep it so."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sidecar_testkit import make_adapter

from lorafleet.core.config import BaseModelSpec
from lorafleet.sidecar.st_runtime import SentenceTransformerRuntime

TEXTS = ["der käufer zahlt den preis", "die ware kommt bald an", "quick fox", "a much longer sentence " * 4]


@pytest.fixture(scope="module")
def dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("st-lora")
    return {name: make_adapter(tiny_model_dir, root / name, seed) for seed, name in enumerate(["p", "q", "s"], 31)}


def runtime(tiny_model_dir: Path) -> SentenceTransformerRuntime:
    return SentenceTransformerRuntime(BaseModelSpec(name="tiny", source=str(tiny_model_dir)), device="cpu")


def alone(tiny_model_dir: Path, path: Path) -> np.ndarray:
    """The reference: the adapter as the only one, loaded by transformers' general path."""
    rt = runtime(tiny_model_dir)
    rt.load_adapter("x", str(path))
    rt._activate("x")  # peft's own forward with the adapter active, through model.encode
    return rt._raw_encode(TEXTS)


def test_adapters_added_beside_others_equal_the_general_path(tiny_model_dir: Path, dirs: dict[str, Path]) -> None:
    rt = runtime(tiny_model_dir)
    rt.load_adapter("p", str(dirs["p"]))  # the first one puts the LoRA layers on the model (general path)
    layers = rt._slots.layers()
    assert rt._slots.targets(rt.read_adapter("q", str(dirs["q"])).config,
                             rt.read_adapter("q", str(dirs["q"])).tensors) is not None  # q takes the fast path
    rt.load_adapter("q", str(dirs["q"]))
    rt.load_adapter_weights("s", rt.read_adapter("s", str(dirs["s"])))
    assert rt._slots.layers() is layers  # no module walk: the same layers hold the new adapters
    for name in ("p", "q", "s"):
        np.testing.assert_allclose(rt.encode(TEXTS, name), alone(tiny_model_dir, dirs[name]), atol=1e-5)
    base = rt.encode(TEXTS, None)
    assert np.abs(rt.encode(TEXTS, "q") - base).max() > 1e-3  # the adapter changes the vectors
    mixed = rt.encode_mixed(TEXTS, ["q", None, "s", "p"])
    for i, name in enumerate(["q", None, "s", "p"]):
        np.testing.assert_allclose(mixed[i], rt.encode(TEXTS, name)[i], atol=1e-5)

    # Unload in any order, down to none, and load again: nothing of a removed adapter stays behind.
    rt.unload_adapter("p")
    assert "p" not in rt.model.transformers_model.peft_config
    assert all("p" not in layer.lora_A for layer in layers.values())
    np.testing.assert_allclose(rt.encode(TEXTS, "s"), alone(tiny_model_dir, dirs["s"]), atol=1e-5)
    rt.unload_adapter("q")
    rt.unload_adapter("s")  # the last one: the general path takes the LoRA bookkeeping off the model
    assert rt.loaded_adapters() == []
    np.testing.assert_allclose(rt.encode(TEXTS, None), base, atol=1e-5)
    rt.load_adapter("q", str(dirs["q"]))
    rt.load_adapter("p", str(dirs["p"]))
    np.testing.assert_allclose(rt.encode(TEXTS, "p"), alone(tiny_model_dir, dirs["p"]), atol=1e-5)


def test_other_adapters_take_the_general_path(tiny_model_dir: Path, dirs: dict[str, Path], tmp_path: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from sentence_transformers import SentenceTransformer

    rt = runtime(tiny_model_dir)
    rt.load_adapter("p", str(dirs["p"]))
    torch.manual_seed(5)
    st = SentenceTransformer(str(tiny_model_dir), device="cpu")
    # Other target modules: the fast path has no layers for them and must not take it.
    get_peft_model(st.transformers_model, LoraConfig(r=4, lora_alpha=8, target_modules=["key"],
                                                      init_lora_weights=False)).save_pretrained(str(tmp_path / "k"))
    weights = rt.read_adapter("k", str(tmp_path / "k"))
    assert rt._slots.targets(weights.config, weights.tensors) is None
    rt.load_adapter("k", str(tmp_path / "k"))
    np.testing.assert_allclose(rt.encode(TEXTS, "k"), alone(tiny_model_dir, tmp_path / "k"), atol=1e-5)
    np.testing.assert_allclose(rt.encode(TEXTS, "p"), alone(tiny_model_dir, dirs["p"]), atol=1e-5)


def test_switching_adapters_touches_no_global_state(tiny_model_dir: Path, dirs: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """set_adapter / enable_adapters / disable_adapters walk every module of every loaded adapter (their cost
    grows with the adapters loaded): after the first batch, batches of any adapter, the bare base, mixed
    batches and adapter loads and unloads call none of them."""
    rt = runtime(tiny_model_dir)
    rt.load_adapter("p", str(dirs["p"]))
    rt.encode(TEXTS, "p")
    calls: list[str] = []
    for name in ("set_adapter", "enable_adapters", "disable_adapters"):
        original = getattr(rt.model, name)
        monkeypatch.setattr(rt.model, name, lambda *a, _n=name, _o=original, **k: (calls.append(_n), _o(*a, **k))[1])
    rt.load_adapter("q", str(dirs["q"]))
    rt.load_adapter_weights("s", rt.read_adapter("s", str(dirs["s"])))
    for adapter in ("q", None, "s", "p", None, "q"):
        rt.encode(TEXTS, adapter)
    rt.encode_mixed(TEXTS, ["s", None, "q", "p"])
    rt.unload_adapter("q")
    np.testing.assert_allclose(rt.encode(TEXTS, "s"), alone(tiny_model_dir, dirs["s"]), atol=1e-5)
    np.testing.assert_allclose(rt.encode(TEXTS, None), runtime(tiny_model_dir).encode(TEXTS, None), atol=1e-5)
    assert calls == []
