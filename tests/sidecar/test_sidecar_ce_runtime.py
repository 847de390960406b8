"""The cross-encoder runtime (`score`) on a tiny random BERT: base and two LoRA adapters (each with its own
classification head) equal CrossEncoder.predict, and an adapter saved and loaded again scores as before."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import numpy as np
import pytest

from lorafleet.core import wire
from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.core.config import BaseModelSpec
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.batcher import Batch, Pulled, form_batches
from lorafleet.sidecar.ce_runtime import CrossEncoderRuntime, load_cross_encoder
from lorafleet.sidecar.runtime import runtime_class
from lorafleet.sidecar.scoring import cut_pairs
from lorafleet.sidecar.settle import Outcome

PAIRS = [("wer zahlt den Kaufpreis?", "Der Käufer ist verpflichtet, den Kaufpreis zu zahlen."),
         ("wer zahlt den Kaufpreis?", "kurz"),
         ("quick fox", "The quick brown fox jumps over the lazy dog, again and again and again."),
         ("quick fox", "")]


def _lora(head: bool) -> object:
    from peft import LoraConfig, TaskType

    return LoraConfig(task_type=TaskType.SEQ_CLS, r=4, lora_alpha=8, target_modules=["query", "value"],
                      modules_to_save=["classifier"] if head else None)


def _randomize(model: object, seed: int, head: bool) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.model.named_parameters():  # type: ignore[attr-defined]
            if "lora_B" in name or (head and "modules_to_save" in name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[dict[str, Path], dict[str | None, np.ndarray]]:
    """Two adapters (LoRA + own head) trained-by-noise in memory, their scores there, then saved to disk."""
    import torch
    from sentence_transformers.cross_encoder import CrossEncoder

    out = tmp_path_factory.mktemp("ce-adapters")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # what every worker draws a missing head from (ce_runtime.FRESH_HEAD_SEED)
        plain = CrossEncoder(str(tiny_model_dir), num_labels=1, device="cpu")
    refs: dict[str | None, np.ndarray] = {None: plain.predict(PAIRS)}
    paths: dict[str, Path] = {}
    for name, seed in (("a", 1), ("b", 2)):
        model = load_cross_encoder(str(tiny_model_dir))
        model.add_adapter(_lora(head=True), adapter_name=name)
        _randomize(model, seed, head=True)
        model.model.set_adapter(name)
        refs[name] = model.predict(PAIRS)
        paths[name] = out / name
        model.save_pretrained(str(paths[name]))
    model = load_cross_encoder(str(tiny_model_dir))
    model.add_adapter(_lora(head=False), adapter_name="headless")
    _randomize(model, 3, head=False)
    paths["headless"] = out / "headless"
    model.save_pretrained(str(paths["headless"]))
    return paths, refs


def runtime(tiny_model_dir: Path) -> CrossEncoderRuntime:
    return CrossEncoderRuntime(BaseModelSpec(name="tiny-ce", source=str(tiny_model_dir), runtime="cross-encoder"),
                               device="cpu")


def test_plugin_declares_score_only() -> None:
    cls = runtime_class("cross-encoder")
    assert cls is CrossEncoderRuntime and cls.capabilities == frozenset({wire.SCORE})


def test_base_and_adapters_equal_crossencoder_predict(
        tiny_model_dir: Path, adapters: tuple[dict[str, Path], dict[str | None, np.ndarray]]) -> None:
    paths, refs = adapters
    rt = runtime(tiny_model_dir)
    assert rt.max_length == load_cross_encoder(str(tiny_model_dir)).max_length
    rt.load_adapter("a", str(paths["a"]))
    rt.load_adapter("b", str(paths["b"]))
    for adapter in [None, "a", "b", None, "b", "a", None, "a"]:
        got = rt.score(PAIRS, adapter)
        assert got.dtype == np.float32 and got.shape == (len(PAIRS),)
        np.testing.assert_allclose(got, refs[adapter], rtol=0, atol=1e-6, err_msg=str(adapter))
    # The adapters really change the scores, and differently (their heads are their own).
    assert np.abs(refs["a"] - refs[None]).max() > 1e-3 and np.abs(refs["a"] - refs["b"]).max() > 1e-3
    rt.unload_adapter("a")
    assert rt.loaded_adapters() == ["b"]
    np.testing.assert_allclose(rt.score(PAIRS, "b"), refs["b"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(rt.score(PAIRS, None), refs[None], rtol=0, atol=1e-6)
    rt.close()


def test_mixed_pairs_score_as_their_own_adapter_and_head(
        tiny_model_dir: Path, adapters: tuple[dict[str, Path], dict[str | None, np.ndarray]]) -> None:
    """One forward pass over pairs of two adapters and the bare base (peft's mixed-batch forward, heads included)
    equals one `score` per adapter."""
    from lorafleet.sidecar.runtime import Runtime

    paths, refs = adapters
    rt = runtime(tiny_model_dir)
    assert rt.mixed_adapters
    rt.load_adapter("a", str(paths["a"]))
    rt.load_adapter("b", str(paths["b"]))
    rows = [(i, a) for a in ("b", None, "a") for i in range(len(PAIRS))]
    rows = rows[1::2] + rows[::2]  # interleaved: neighbours differ
    pairs, names = [PAIRS[i] for i, _ in rows], [a for _, a in rows]
    want = np.array([refs[a][i] for i, a in rows], dtype=np.float32)
    got = rt.score_mixed(pairs, names)
    assert got.dtype == np.float32 and got.shape == (len(rows),)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(Runtime.score_mixed(rt, pairs, names), want, rtol=0, atol=1e-5)  # the per-adapter way
    # The mixed pass leaves no adapter switched on or off behind it.
    for adapter in (None, "a", "b"):
        np.testing.assert_allclose(rt.score(PAIRS, adapter), refs[adapter], rtol=0, atol=1e-6)
    np.testing.assert_allclose(rt.score_mixed(pairs, names), want, rtol=0, atol=1e-5)
    with pytest.raises(KeyError, match="'c'"):
        rt.score_mixed(PAIRS[:2], ["a", "c"])
    with pytest.raises(ValueError, match="adapter ids"):
        rt.score_mixed(PAIRS[:2], ["a"])


def test_a_mixed_score_batch_answers_each_task_with_its_adapter(
        tiny_model_dir: Path, adapters: tuple[dict[str, Path], dict[str | None, np.ndarray]], tmp_path: Path) -> None:
    from dataclasses import replace

    from lorafleet.core.config import ServingProfile
    from lorafleet.sidecar.scoring import score_batch

    paths, refs = adapters
    # The bare base's tasks are served only where the checkpoint ships its head (a drawn one is refused, issue 44:
    # tests/sidecar/test_sidecar_ce_head.py): the tiny BERT saved with the head the seed draws, so refs[None] holds.
    load_cross_encoder(str(tiny_model_dir)).save_pretrained(str(tmp_path / "with-head"))
    rt = runtime(tmp_path / "with-head")
    assert rt.trained_head is True
    rt.load_adapter("a", str(paths["a"]))
    rt.load_adapter("b", str(paths["b"]))
    queries = sorted({q for q, _ in PAIRS})
    tasks = []
    for n, adapter in enumerate(["a", None, "b", "a", "b"]):
        query = queries[n % 2]
        docs = tuple(d for q, d in PAIRS if q == query)
        tasks.append(Pulled(wire.Task(id=f"r.{n}", request_id="r", index=n, model="m", base="tiny-ce", text=query,
                                      tokens=40, deadline=1e12, reply="_INBOX.x", op=wire.SCORE, adapter=adapter,
                                      params=wire.ScoreParams(docs).to_params()), msg=None))
    batches = form_batches(tasks, lambda base, adapter: ServingProfile(), frozenset({"tiny-ce"}))
    assert len(batches) == 1 and batches[0].mixed
    # Whole, and cut into runtime calls of 2 pairs (2 × 20 tokens: each task claims 40 for its 2 documents).
    for batch in (batches[0], replace(batches[0], profile=ServingProfile(max_batch_tokens=40))):
        outcomes = score_batch(rt, batch, list(range(len(batch.items))))
        _check(batch, outcomes, refs)


def _check(batch: Batch, outcomes: list[Outcome], refs: dict[str | None, np.ndarray]) -> None:
    for p, outcome in zip(batch.items, outcomes, strict=True):
        assert outcome.situation is Situation.OK and outcome.scores is not None, outcome
        query = p.task.text
        want = [refs[p.task.adapter][i] for i, (q, _) in enumerate(PAIRS) if q == query]
        got = np.frombuffer(outcome.scores.data, dtype="<f4")
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=str(p.task.adapter))


def test_saved_adapter_carries_its_head_and_reloads_identically(
        tiny_model_dir: Path, adapters: tuple[dict[str, Path], dict[str | None, np.ndarray]]) -> None:
    from safetensors.torch import load_file

    paths, refs = adapters
    saved = load_file(str(paths["a"] / "adapter_model.safetensors"))
    assert any("classifier" in k for k in saved), sorted(saved)
    assert json.loads((paths["a"] / "adapter_config.json").read_text())["modules_to_save"] == ["classifier"]
    first, second = runtime(tiny_model_dir), runtime(tiny_model_dir)  # two workers: the same base head too
    first.load_adapter("a", str(paths["a"]))
    second.load_adapter("x", str(paths["a"]))
    np.testing.assert_array_equal(first.score(PAIRS, "a"), second.score(PAIRS, "x"))
    np.testing.assert_array_equal(first.score(PAIRS, None), second.score(PAIRS, None))
    np.testing.assert_allclose(second.score(PAIRS, "x"), refs["a"], rtol=0, atol=1e-6)


def test_adapter_without_its_head_is_refused(
        tiny_model_dir: Path, adapters: tuple[dict[str, Path], dict[str | None, np.ndarray]]) -> None:
    paths, _ = adapters
    rt = runtime(tiny_model_dir)
    with pytest.raises(AdapterUnavailable, match="modules_to_save"):
        rt.load_adapter("headless", str(paths["headless"]))
    assert rt.loaded_adapters() == []


def test_score_wire_is_strict() -> None:
    task = wire.Task(id="r.0", request_id="r", index=0, model="m", base="m", text="q", tokens=10, deadline=1e12,
                     reply="_INBOX.x", op=wire.SCORE, params=wire.ScoreParams(("d1", "d2")).to_params())
    back = wire.Task.from_wire(task.to_wire())
    assert back.op == wire.SCORE and wire.ScoreParams.of(back).documents == ("d1", "d2")
    for bad in ({}, {"d": []}, {"d": ["ok", 3]}, {"d": "d1"}):
        t = wire.Task.from_wire(task.to_wire())
        t.params = bad
        with pytest.raises(wire.MalformedTask):
            wire.ScoreParams.of(wire.Task.from_wire(t.to_wire()))
    scores = np.array([0.25, -1.5], dtype="<f4")
    r = wire.Result.from_wire(wire.Result("r.0", 0, "w", scores=scores.tobytes()).to_wire())
    assert r.check() is None and r.score_array().tolist() == [0.25, -1.5]
    assert wire.Result("r.0", 0, "w", scores=b"abc").check() is not None
    body = msgpack.unpackb(wire.Result("r.0", 0, "w", scores=scores.tobytes()).to_wire())
    body["sc"] = "not bytes"
    with pytest.raises(wire.WireError, match="'sc'"):
        wire.Result.from_wire(msgpack.packb(body))


def test_pairs_are_cut_under_the_token_budget() -> None:
    lengths = [10, 50, 10, 50, 10, 200]
    calls = cut_pairs(lengths, 100)
    assert sorted(i for c in calls for i in c) == list(range(len(lengths)))
    for c in calls:
        assert len(c) == 1 or len(c) * max(lengths[i] for i in c) <= 100
    assert [5] in calls  # longer than the whole budget: alone
