"""A cross-encoder base whose score head is drawn at load (issue 44): told from a checkpoint that ships its head
by the checkpoint's weights, not by the loader; the worker refuses its bare score tasks (answering the adapters').
The gateway's side: tests/serve/test_serve_rerank_base.py and tests/serve/test_serve_rerank.py.

A tiny random BERT stands in for the packaged MiniLM (no head), the same BERT saved as a CrossEncoder for a hub
cross-encoder (its head in the checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lorafleet.core import wire
from lorafleet.core.config import BaseModelSpec, ServingProfile
from lorafleet.models.checkpoints import head_in_checkpoint, untrained_head_message, weight_keys
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.batcher import Pulled, form_batches
from lorafleet.sidecar.ce_runtime import CrossEncoderRuntime, load_cross_encoder
from lorafleet.sidecar.scoring import score_batch

QUERY = "wer zahlt den Kaufpreis?"
DOCS = ("Der Käufer ist verpflichtet, den Kaufpreis zu zahlen.", "kurz")


@pytest.fixture(scope="module")
def made(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny BERT saved as a CrossEncoder (its seeded head in the checkpoint), and an adapter with its head."""
    from lorafleet.testing import add_random_ce_adapter

    out = tmp_path_factory.mktemp("ce-head")
    model = load_cross_encoder(str(tiny_model_dir))
    model.save_pretrained(str(out / "with-head"))
    add_random_ce_adapter(model, "spec", r=2, seed=5, scale=0.5)
    model.save_pretrained(str(out / "spec"))
    return {"with-head": out / "with-head", "spec": out / "spec"}


def _save(folder: Path, names: list[str]) -> Path:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: torch.zeros(1) for n in names}, str(folder / "model.safetensors"))
    return folder


def test_the_head_counts_when_the_checkpoint_has_its_weights(tiny_model_dir: Path, made: dict[str, Path],
                                                             tmp_path: Path) -> None:
    assert head_in_checkpoint(str(tiny_model_dir)) is False  # a plain BERT: the loader would draw the head
    assert head_in_checkpoint(str(made["with-head"])) is True
    assert head_in_checkpoint("all-MiniLM-L6-v2") is False  # the default fleet's -ce base
    assert head_in_checkpoint("no-such-org/no-such-cross-encoder") is None  # not here: cannot tell
    # Decoder heads (`score`), sharded checkpoints (the index), and a sentence-transformers module folder.
    assert head_in_checkpoint(str(_save(tmp_path / "llama", ["model.norm.weight", "score.weight"]))) is True
    assert head_in_checkpoint(str(_save(tmp_path / "near", ["bert.classifier_x", "cls.predictions.bias"]))) is False
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"roberta.embeddings.x": "a.safetensors", "classifier.out_proj.weight": "b.safetensors"}}))
    assert weight_keys(sharded) == ["roberta.embeddings.x", "classifier.out_proj.weight"]
    assert head_in_checkpoint(str(sharded)) is True
    st = tmp_path / "st"
    _save(st / "0_Transformer", ["bert.embeddings.x", "classifier.weight"])
    (st / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "0_Transformer",
                                                  "type": "sentence_transformers.models.Transformer"}]))
    assert head_in_checkpoint(str(st)) is True
    import torch

    (tmp_path / "bin").mkdir()
    torch.save({"bert.pooler.dense.weight": torch.zeros(1), "classifier.weight": torch.zeros(1)},
               tmp_path / "bin" / "pytorch_model.bin")
    assert head_in_checkpoint(str(tmp_path / "bin")) is True
    (tmp_path / "empty").mkdir()
    assert head_in_checkpoint(str(tmp_path / "empty")) is None


def _batch(adapters: list[str | None]) -> object:
    tasks = [Pulled(wire.Task(id=f"r.{n}", request_id="r", index=n, model="m", base="tiny-ce", text=QUERY,
                              tokens=40, deadline=1e12, reply="_INBOX.x", op=wire.SCORE, adapter=a,
                              params=wire.ScoreParams(DOCS).to_params()), msg=None)
             for n, a in enumerate(adapters)]
    batches = form_batches(tasks, lambda base, adapter: ServingProfile(), frozenset({"tiny-ce"}))
    assert len(batches) == 1
    return batches[0]


def _runtime(source: Path) -> CrossEncoderRuntime:
    return CrossEncoderRuntime(BaseModelSpec(name="tiny-ce", source=str(source), runtime="cross-encoder"))


def test_a_drawn_head_serves_its_adapters_only(tiny_model_dir: Path, made: dict[str, Path]) -> None:
    """Mixed batch of bare-base and specialist tasks: the bare ones are refused (invalid, naming the fix), the
    specialist's are answered with its own head; a base that ships its head answers its bare tasks."""
    drawn = _runtime(tiny_model_dir)
    assert drawn.trained_head is False
    drawn.load_adapter("spec", str(made["spec"]))
    want_spec = drawn.score([(QUERY, d) for d in DOCS], "spec")
    batch = _batch([None, "spec", None])
    assert batch.mixed  # type: ignore[attr-defined]
    out = score_batch(drawn, batch, [0, 1, 2])  # type: ignore[arg-type]
    assert [o.situation for o in out] == [Situation.INVALID, Situation.OK, Situation.INVALID]
    assert out[0].message == untrained_head_message("tiny-ce") and "lorafleet promote" in out[0].message
    assert out[1].scores is not None
    np.testing.assert_allclose(np.frombuffer(out[1].scores.data, dtype="<f4"), want_spec, rtol=0, atol=1e-6)
    only_bare = _batch([None, None])
    assert not only_bare.mixed  # type: ignore[attr-defined]
    out = score_batch(drawn, only_bare, [0, 1])  # type: ignore[arg-type]
    assert [o.situation for o in out] == [Situation.INVALID, Situation.INVALID]

    shipped = _runtime(made["with-head"])
    assert shipped.trained_head is True
    out = score_batch(shipped, _batch([None, None]), [0, 1])  # type: ignore[arg-type]
    assert [o.situation for o in out] == [Situation.OK, Situation.OK]
    # The saved head is the one the seed drew: the same scores, now from the checkpoint.
    want = drawn.score([(QUERY, d) for d in DOCS], None)
    assert out[0].scores is not None
    np.testing.assert_allclose(np.frombuffer(out[0].scores.data, dtype="<f4"), want, rtol=0, atol=1e-6)

