"""Issue 39, item 3: `precision: auto` on the sentence-transformers runtime decides per served model (base + adapter):
a bundle's tuned verdict where it has one, else a probe with the adapter loaded on statute-length passages, cached per
adapter. Before, it probed 12 short sentences on the bare base once per base and device, whatever the adapters.
Tiny random BERT and LoRA built on the fly; bf16 is offered as a candidate on any CPU (it runs everywhere, natively
or not), so the logic is tested on every machine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sidecar_testkit import make_adapter

from lorafleet.core.config import BaseModelSpec
from lorafleet.models import precision
from lorafleet.models.precision import JudgedModel
from lorafleet.sidecar.st_runtime import SentenceTransformerRuntime


@pytest.fixture(autouse=True)
def _bf16_offered(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(precision.AUTO_ENV, raising=False)  # the suite pins `auto` to fp32 (tests/conftest.py)
    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(SentenceTransformerRuntime, "precisions", classmethod(lambda cls, d: frozenset({"fp32",
                                                                                                      "bf16"})))


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("per-model")
    return {name: make_adapter(tiny_model_dir, root / name, seed) for seed, name in enumerate(["a", "b"], 41)}


def _auto(tiny_model_dir: Path) -> SentenceTransformerRuntime:
    return SentenceTransformerRuntime(BaseModelSpec(name="tiny", source=str(tiny_model_dir)), device="cpu")


def test_a_tuned_verdict_decides_without_a_probe(tiny_model_dir: Path, adapters: dict[str, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SentenceTransformerRuntime, "_probe", lambda *a, **k: pytest.fail("probed"))
    rt = _auto(tiny_model_dir)
    assert rt.use_judged([JudgedModel("fp32", str(adapters["a"]), "a")]).precision == "fp32"
    rt = _auto(tiny_model_dir)
    verdict = rt.use_judged([JudgedModel("bf16", str(adapters["a"]), "a"), JudgedModel("bf16", None, "b")])
    assert verdict.precision == "bf16" and rt.precision == "bf16"
    assert rt.model.transformers_model.dtype.is_floating_point and "bfloat16" in str(rt.model.transformers_model.dtype)


def test_without_a_verdict_each_adapter_is_probed_loaded_on_long_passages(tiny_model_dir: Path,
                                                                          adapters: dict[str, Path],
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    seen: list[tuple[str, str | None, int]] = []
    real = SentenceTransformerRuntime._probe

    def counted(self: SentenceTransformerRuntime, texts: list[str], at: str, adapter: Path | None = None
                ) -> np.ndarray:
        seen.append((at, adapter.name if adapter is not None else None, max(len(t) for t in texts)))
        return real(self, texts, at, adapter)

    monkeypatch.setattr(SentenceTransformerRuntime, "_probe", counted)
    rt = _auto(tiny_model_dir)
    rt.use_judged([JudgedModel(None, str(adapters["a"]), "a")])
    assert [(at, name) for at, name, _ in seen] == [("fp32", "a"), ("bf16", "a")]  # with its adapter
    assert min(n for _, _, n in seen) > 300  # statute-length passages among the probe texts, not 12 short sentences
    # Per served model: another adapter on the same base and device is probed again (the cache was per base).
    rt = _auto(tiny_model_dir)
    rt.use_judged([JudgedModel(None, str(adapters["b"]), "b")])
    assert [(at, name) for at, name, _ in seen[2:]] == [("fp32", "b"), ("bf16", "b")]
    cache = json.loads((tmp_path / "home" / precision.CACHE_FILE).read_text())
    assert sum("|adapter " in key for key in cache) == 2
    rt = _auto(tiny_model_dir)  # the same adapter again: its cached verdict
    assert rt.use_judged([JudgedModel(None, str(adapters["a"]), "a")]).precision == rt.precision
    assert len(seen) == 4


def test_one_adapter_failing_the_probe_keeps_the_base_at_fp32(tiny_model_dir: Path, adapters: dict[str, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    real = SentenceTransformerRuntime._probe

    def skewed(self: SentenceTransformerRuntime, texts: list[str], at: str, adapter: Path | None = None
               ) -> np.ndarray:
        vectors = real(self, texts, at, adapter)
        if at == "bf16" and adapter is not None and adapter.name == "b":  # this adapter loses quality at bf16
            vectors = vectors + np.random.default_rng(0).normal(0, 0.5, vectors.shape).astype(np.float32)
        return vectors

    monkeypatch.setattr(SentenceTransformerRuntime, "_probe", skewed)
    rt = _auto(tiny_model_dir)
    alone = rt.use_judged([JudgedModel(None, str(adapters["a"]), "a")])
    rt = _auto(tiny_model_dir)
    both = rt.use_judged([JudgedModel(None, str(adapters["a"]), "a"), JudgedModel(None, str(adapters["b"]), "b")])
    assert alone.precision == "bf16" and both.precision == "fp32" and rt.precision == "fp32"
    assert "judged at bf16, fp32" in both.reason


def test_an_explicit_precision_is_kept_and_a_different_verdict_is_an_override(tiny_model_dir: Path) -> None:
    rt = SentenceTransformerRuntime(BaseModelSpec(name="tiny", source=str(tiny_model_dir), precision="fp32"), "cpu")
    served = rt.use_judged([JudgedModel("bf16")])
    assert rt.precision == "fp32" and served.override
