"""Precision on the sentence-transformers runtime: bf16 vectors of the base and of adapters mixed in one batch match
fp32's within the guard; int8 takes no adapters and fails the guard on MiniLM; an unsupported precision is a
ConfigError; `auto` runs the guard once per model and device and caches what it chose."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
from sidecar_testkit import make_adapter

from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.core.config import BaseModelSpec, ConfigError
from lorafleet.models import precision
from lorafleet.sidecar.runtime import create_runtime
from lorafleet.sidecar.st_runtime import SentenceTransformerRuntime

ADAPTERS = ["p1", "p2"]
WORDS = ["der", "käufer", "zahlt", "den", "preis", "und", "die", "ware", "kommt", "bald", "an", "fox", "dog", "quick"]
NATIVE_BF16 = "bf16" in precision.supported_precisions("cpu")
needs_bf16 = pytest.mark.skipif(not NATIVE_BF16, reason="this CPU has no native bf16 (avx512_bf16/amx_bf16/bf16)")
needs_int8 = pytest.mark.skipif("int8" not in precision.supported_precisions("cpu"), reason="no quantised engine")


@pytest.fixture(autouse=True)
def _unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(precision.AUTO_ENV, raising=False)  # the suite pins `auto` to fp32 (tests/conftest.py)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("precision")
    return {name: make_adapter(tiny_model_dir, root / name, seed) for seed, name in enumerate(ADAPTERS, 31)}


def _runtime(source: Path, at: str, adapters: dict[str, Path] | None = None) -> SentenceTransformerRuntime:
    rt = SentenceTransformerRuntime(BaseModelSpec(name="tiny", source=str(source), precision=at), device="cpu")
    for name, path in (adapters or {}).items():
        rt.load_adapter(name, str(path))
    return rt


def _rows(seed: int, n: int) -> tuple[list[str], list[str | None]]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(1, 24))) for _ in range(n)]
    adapters: list[str | None] = [[None, *ADAPTERS][i % 3] for i in range(n)]
    rng.shuffle(adapters)
    return texts, adapters


@needs_bf16
def test_bf16_base_and_adapters_mixed_in_one_batch_match_fp32(tiny_model_dir: Path,
                                                              adapter_dirs: dict[str, Path]) -> None:
    import torch

    fp32 = _runtime(tiny_model_dir, "fp32", adapter_dirs)
    bf16 = _runtime(tiny_model_dir, "bf16", adapter_dirs)
    assert bf16.precision == "bf16" and bf16.model.transformers_model.dtype == torch.bfloat16
    # The adapter added through LoraSlots keeps its saved dtype; the update is computed in bf16 (st_lora.py).
    layer = next(iter(bf16._slots.layers().values()))
    assert layer.lora_A["p2"].weight.dtype == torch.float32
    texts, adapters = _rows(5, 24)
    assert bf16._slots.groupable(adapters)
    got = bf16.encode_mixed(texts, adapters)  # the grouped batched-matmul update, at bf16
    want = fp32.encode_mixed(texts, adapters)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert precision.min_cosine(got, want) >= precision.GUARD_MIN_COSINE
    # Normalised vectors stay unit length in float32, although bf16 keeps a length only to ~1e-3.
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # Each adapter changes its rows at bf16 too: a row on the wrong adapter would not match fp32 above.
    bare = bf16.encode(texts, None)
    on = [i for i, a in enumerate(adapters) if a is not None]
    assert (np.sum(got[on] * bare[on], axis=1) < 0.9999).all()
    # One adapter per batch (peft's own forward) and the bare base agree at bf16 as well.
    for adapter in (None, *ADAPTERS):
        one = bf16.encode(texts, adapter)
        assert precision.min_cosine(one, fp32.encode(texts, adapter)) >= precision.GUARD_MIN_COSINE, adapter


@needs_int8
def test_int8_base_serves_the_bare_base_and_refuses_adapters(tiny_model_dir: Path,
                                                             adapter_dirs: dict[str, Path]) -> None:
    rt = _runtime(tiny_model_dir, "int8")
    assert rt.precision == "int8"
    assert rt.encode(["der käufer zahlt"], None).dtype == np.float32
    with pytest.raises(AdapterUnavailable, match="int8"):
        rt.load_adapter("p1", str(adapter_dirs["p1"]))
    with pytest.raises(AdapterUnavailable, match="int8"):
        rt.load_adapter_weights("p1", rt.read_adapter("p1", str(adapter_dirs["p1"])))
    assert rt.loaded_adapters() == []


def test_unsupported_explicit_precision_is_a_config_error(tiny_model_dir: Path) -> None:
    spec = BaseModelSpec(name="tiny", source=str(tiny_model_dir), precision="fp16")
    with pytest.raises(ConfigError, match=r"'fp16'.*supports .*fp32"):
        create_runtime(spec, "cpu")
    with pytest.raises(ConfigError, match="fp16"):
        SentenceTransformerRuntime(spec, device="cpu")
    if not NATIVE_BF16:
        with pytest.raises(ConfigError, match="bf16"):
            create_runtime(spec.model_copy(update={"precision": "bf16"}), "cpu")


@needs_bf16
def test_auto_runs_the_guard_once_and_caches_the_verdict(tiny_model_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path / "home"))
    probes: list[str] = []
    real = SentenceTransformerRuntime._probe

    def counted(self: SentenceTransformerRuntime, texts: list[str], at: str, adapter: Path | None = None
                ) -> np.ndarray:
        probes.append(at)
        return real(self, texts, at, adapter)

    monkeypatch.setattr(SentenceTransformerRuntime, "_probe", counted)
    with caplog.at_level(logging.INFO, logger="lorafleet.sidecar.st_runtime"):
        first = _runtime(tiny_model_dir, "auto")
        assert first.precision == "fp32" and probes == []  # decided per served model, once the worker knows them
        first.use_judged([])  # no model served: the bare base is what it serves
    assert first.precision == "bf16" and probes == ["fp32", "bf16"]  # int8 is never a candidate (no adapters)
    assert "the bare base probed: bf16 min cosine" in caplog.text  # the probe says what it measured
    assert "precision auto → bf16 (auto: every served model was judged at bf16)" in caplog.text
    cached = json.loads((tmp_path / "home" / precision.CACHE_FILE).read_text())
    (entry,) = cached.values()
    assert entry["precision"] == "bf16" and entry["cosines"]["bf16"] >= precision.GUARD_MIN_COSINE
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lorafleet.sidecar.st_runtime"):
        second = _runtime(tiny_model_dir, "auto")
        second.use_judged([])
    assert second.precision == "bf16" and probes == ["fp32", "bf16"]  # no probe on the second start
    assert "(cached)" in caplog.text


def test_pinned_auto_skips_the_guard(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(precision.AUTO_ENV, "fp32")
    monkeypatch.setattr(SentenceTransformerRuntime, "_probe", lambda *a: pytest.fail("probed"))
    rt = _runtime(tiny_model_dir, "auto")
    rt.use_judged([])
    assert rt.precision == "fp32"


# -- MiniLM, the packaged model (integration) ---------------------------------------------------------------------

@needs_int8
def test_int8_dynamic_fails_the_guard_on_minilm_so_auto_never_picks_it(minilm_path: Path, tmp_path: Path) -> None:
    rt = SentenceTransformerRuntime(BaseModelSpec(name="minilm", precision="fp32"), device="cpu")
    probe = list(precision.PROBE_SENTENCES)
    ref = rt._probe(probe, "fp32")
    int8 = precision.min_cosine(rt._probe(probe, "int8"), ref)
    print(f"MiniLM probe min cosine to fp32: int8 {int8:.5f}")
    assert int8 < precision.GUARD_MIN_COSINE
    # Even offered as a candidate, the guard rejects it.
    verdict = precision.choose_auto("minilm-int8", ["int8"], lambda p: rt._probe(probe, p), tmp_path / "p.json")
    assert verdict.precision == "fp32" and verdict.cosines["int8"] < precision.GUARD_MIN_COSINE
    if NATIVE_BF16:
        bf16 = precision.min_cosine(rt._probe(probe, "bf16"), ref)
        print(f"MiniLM probe min cosine to fp32: bf16 {bf16:.5f}")
        assert bf16 >= precision.GUARD_MIN_COSINE


# -- a worker process: heartbeats say each base's precision, `lorafleet status` shows it -----------------------------

def test_heartbeats_carry_each_bases_precision(nats_server: object, start_worker: object, tiny_model_dir: Path,
                                               tiny_adapters: dict[str, Path],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    from sidecar_testkit import BASE, fleet_dict

    from lorafleet.cli.status import _print

    fleet = fleet_dict(tiny_model_dir, tiny_adapters)
    explicit = "bf16" if NATIVE_BF16 else "fp32"
    fleet["bases"][0]["precision"] = explicit
    fleet["bases"].append({"name": "tiny-auto", "source": str(tiny_model_dir)})  # auto: the guard runs in the worker
    worker = start_worker(fleet, nats_server.url, "prec")  # type: ignore[operator,attr-defined]
    hb = asyncio.run(_heartbeat_with_bases(nats_server.url, worker.worker_id, 2))  # type: ignore[attr-defined]
    assert hb.precisions == {BASE: explicit, "tiny-auto": explicit}  # the tiny BERT passes the guard at bf16
    from dataclasses import asdict

    capsys.readouterr()
    _print({"source": "nats", "nats_url": "x", "cluster": {}, "workers": {"prec": asdict(hb)}, "queue": {}}, None)
    lines = capsys.readouterr().out.splitlines()
    assert any(f"precision {BASE} {explicit}, tiny-auto {explicit}" in line for line in lines), lines


async def _heartbeat_with_bases(url: str, worker_id: str, n: int) -> object:
    import nats

    from lorafleet.core.wire import Heartbeat, heartbeat_subject

    nc = await nats.connect(url)
    try:
        sub = await nc.subscribe(heartbeat_subject(worker_id))
        while True:  # the first heartbeats may come before both bases pull
            hb = Heartbeat.from_wire((await sub.next_msg(timeout=10)).data)
            if len(hb.precisions) == n:
                return hb
    finally:
        await nc.close()


def test_fp32_means_fp32_for_a_checkpoint_saved_in_bf16(tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch
    from sentence_transformers import SentenceTransformer

    saved = SentenceTransformer(str(tiny_model_dir), device="cpu").to(torch.bfloat16)
    saved.save(str(tmp_path / "bf16-checkpoint"))
    loaded = SentenceTransformer(str(tmp_path / "bf16-checkpoint"), device="cpu")
    assert loaded.transformers_model.dtype == torch.bfloat16  # transformers loads the dtype its config names
    rt = _runtime(tmp_path / "bf16-checkpoint", "fp32")
    assert rt.precision == "fp32" and rt.model.transformers_model.dtype == torch.float32
    assert rt.encode(["der käufer zahlt"], None).dtype == np.float32


# -- the generation runtimes map a precision to their dtype ------------------------------------------------------

def test_transformers_runtime_serves_the_precision_as_its_dtype(tmp_path: Path) -> None:
    import torch

    from lorafleet.sidecar.transformers_runtime import TransformersRuntime
    from lorafleet.testing import build_tiny_llama

    base = build_tiny_llama(tmp_path / "llama")
    spec = BaseModelSpec(name="llm", source=str(base), runtime="transformers")
    assert TransformersRuntime(spec, "cpu").precision == "fp32"  # auto on CPU: float32, as before
    at = "bf16" if NATIVE_BF16 else "fp32"
    rt = TransformersRuntime(spec.model_copy(update={"precision": at}), "cpu")
    assert rt.precision == at and rt.model.dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[at]
    with pytest.raises(ConfigError, match="disagree"):
        TransformersRuntime(spec.model_copy(update={"precision": "fp32", "options": {"dtype": "bfloat16"}}), "cpu")
    with pytest.raises(ConfigError, match=r"'int8'.*supports"):  # no quantisation in this runtime
        create_runtime(spec.model_copy(update={"precision": "int8"}), "cpu")


def test_vllm_runtime_passes_the_precision_as_its_dtype(tmp_path: Path) -> None:
    from lorafleet.sidecar.vllm_runtime import VllmRuntime

    assert VllmRuntime.precisions("cpu") == {"fp32", "bf16"}
    assert VllmRuntime.precisions("cuda") == {"fp32", "fp16", "bf16"}
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    spec = BaseModelSpec(name="llm", source=str(model), runtime="vllm")
    # auto: what the served models were judged at (use_judged), fp32 until known; no longer vLLM's CPU default
    # bfloat16, which no gate measured (issue 39, test_sidecar_judged_precision.py)
    assert VllmRuntime(spec, "cpu").config.dtype == "float32"
    rt = VllmRuntime(spec.model_copy(update={"precision": "fp32"}), "cpu")
    assert rt.config.dtype == "float32" and rt.precision == "fp32"
    with pytest.raises(ConfigError, match="disagree"):
        VllmRuntime(spec.model_copy(update={"precision": "fp32", "options": {"dtype": "bfloat16"}}), "cpu")
