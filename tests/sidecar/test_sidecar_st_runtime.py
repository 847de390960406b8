"""The sentence-transformers runtime on the tiny model: base and adapters equal direct peft use."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.core.config import BaseModelSpec
from lorafleet.sidecar.adapters import AdapterCache
from lorafleet.sidecar.runtime import Runtime
from lorafleet.sidecar.st_runtime import SentenceTransformerRuntime

TEXTS = ["Der Käufer ist verpflichtet, den Kaufpreis zu zahlen.", "kurz", "The quick brown fox jumps over the dog."]


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, tiny_adapters: dict[str, Path]) -> dict[str | None, np.ndarray]:
    from sentence_transformers import SentenceTransformer

    out: dict[str | None, np.ndarray] = {None: SentenceTransformer(str(tiny_model_dir), device="cpu").encode(TEXTS)}
    for name in ("a", "b"):
        model = SentenceTransformer(str(tiny_model_dir), device="cpu")
        model.load_adapter(str(tiny_adapters[name]))
        out[name] = model.encode(TEXTS)
    return out


def runtime(tiny_model_dir: Path, **spec: object) -> SentenceTransformerRuntime:
    return SentenceTransformerRuntime(BaseModelSpec(name="tiny", source=str(tiny_model_dir), **spec), device="cpu")


def test_switching_adapters_back_and_forth_matches_direct_use(
        tiny_model_dir: Path, tiny_adapters: dict[str, Path], reference: dict[str | None, np.ndarray]) -> None:
    rt = runtime(tiny_model_dir)
    assert isinstance(rt, Runtime) and rt.dim == reference[None].shape[1]
    rt.load_adapter("a", str(tiny_adapters["a"]))
    rt.load_adapter("b", str(tiny_adapters["b"]))
    for adapter in [None, "a", "b", None, "b", "a", None]:
        got = rt.encode(TEXTS, adapter)
        assert got.dtype == np.float32 and got.shape == reference[None].shape
        assert cos(got, reference[adapter]) > 0.9999, adapter
    assert cos(reference["a"], reference[None]) < 0.999  # the adapter really changes the output
    assert sorted(rt.loaded_adapters()) == ["a", "b"]
    rt.close()


def test_lru_eviction_unloads_from_the_model(
        tiny_model_dir: Path, tiny_adapters: dict[str, Path], reference: dict[str | None, np.ndarray]) -> None:
    rt = runtime(tiny_model_dir)
    cache = AdapterCache(rt, max_adapters=1)
    for adapter in ["a", "b", "a"]:
        cache.ensure(adapter, str(tiny_adapters[adapter]))
        assert rt.loaded_adapters() == [adapter]
        assert cos(rt.encode(TEXTS, adapter), reference[adapter]) > 0.9999
        assert cos(rt.encode(TEXTS, None), reference[None]) > 0.9999
    assert list(rt.model.transformers_model.peft_config) == ["a"]  # b really left the model


def test_bad_adapters_are_unavailable(tiny_model_dir: Path, tmp_path: Path) -> None:
    rt = runtime(tiny_model_dir)
    with pytest.raises(AdapterUnavailable):
        rt.load_adapter("x", str(tmp_path))  # no adapter_config.json
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["nope"]}))
    with pytest.raises(AdapterUnavailable):
        rt.load_adapter("y", str(bad))
    assert rt.loaded_adapters() == []
    assert rt.encode(["still works"], None).shape == (1, rt.dim)


def test_normalize_and_max_seq_length_follow_the_spec(tiny_model_dir: Path) -> None:
    normalized = runtime(tiny_model_dir)  # the tiny model has a Normalize module
    assert np.allclose(np.linalg.norm(normalized.encode(TEXTS, None), axis=1), 1.0, atol=1e-5)
    raw = runtime(tiny_model_dir, normalize=False, max_seq_length=16)
    assert raw.model.max_seq_length == 16 and not raw.normalized
    assert not np.allclose(np.linalg.norm(raw.encode(TEXTS, None), axis=1), 1.0, atol=1e-3)
