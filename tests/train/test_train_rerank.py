"""The rerank task kind on a tiny random BERT and a small bring-your-own pairs table written here: the loss falls,
the adapter (head included) serves identically from the `cross-encoder` runtime, the pipeline reports itself beside
its first stage, RRF fuses as computed by hand, and a two-trial research run logs to a real MLflow store."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from lorafleet.train.kinds.rerank.fusion import fuse_rankings, rrf

SYLLABLES = ["ka", "lo", "mi", "ru", "sen", "tav", "po", "lin", "dar", "fel", "gus", "hep", "vor", "zu"]
WORDS = [a + b for a in SYLLABLES for b in SYLLABLES if a != b]  # 182 pseudo-words, none a German stop word
N_DOCS = 40


def _docs() -> list[tuple[str, str]]:
    """(query, positive): document i owns four words; its query names two of them, one filler and one word of the
    next document, so BM25 is good but not perfect."""
    own = [WORDS[4 * i: 4 * i + 4] for i in range(N_DOCS)]
    filler = WORDS[4 * N_DOCS:]
    out = []
    for i, words in enumerate(own):
        text = " ".join(f"{w} {filler[(i + j) % len(filler)]}" for j, w in enumerate(words * 2))
        out.append((f"{words[0]} {filler[i % len(filler)]} {own[(i + 1) % N_DOCS][1]} {words[2]}", text))
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny BERT (tokenizer trained on this data) and the pairs table."""
    from lorafleet.testing import build_tiny_model

    root = tmp_path_factory.mktemp("rerank")
    docs = _docs()
    model = build_tiny_model(root / "bert", corpus=[t for pair in docs for t in pair], vocab_size=300,
                             max_seq_length=64)
    _sharpen(model)
    with (root / "pairs.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["query", "positive"])
        writer.writerows(docs)
    return model, root / "pairs.csv"


def _sharpen(path: Path, factor: float = 5.0) -> None:
    """Scale the random BERT's weight matrices (and the head's init range) by `factor`. At the usual init (std 0.02)
    attention is near uniform and the [CLS] vector that a cross-encoder's head reads barely depends on the input, so
    a few LoRA steps cannot move the scores (measured: listwise loss 1.09861 → 1.09860); sharpened, they can."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                param.mul_(factor)
    model.config.initializer_range *= factor
    model.save_pretrained(path)


def _train_raw(model: Path, pairs: Path, **kw: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "base_model": str(model),
        "data": {"layout": "pairs", "pairs": str(pairs), "num_negatives": 2, "dev_fraction": 0.2,
                 "test_fraction": 0.2},
        "first_stage": {"kind": "bm25", "embedder": str(model), "depth": 8},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["query", "value"]},
        "learning_rate": 5e-2, "epochs": 5, "batch_size": 4, "warmup_ratio": 0.0, "max_seq_length": 48,
        "max_pair_length": 64, "device": "cpu", "eval_batch_size": 64,
    }
    raw.update(kw)
    return raw


@pytest.fixture(scope="module")
def trained(setup: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from lorafleet.core.tasks import get_task_kind
    from lorafleet.train.kinds.rerank.trainer import train_reranker

    kind = get_task_kind("rerank")
    cfg = kind.parse_config(_train_raw(*setup))
    dataset = kind.build_dataset(cfg)
    calls: list[tuple[int, dict[str, float]]] = []
    result = train_reranker(cfg, dataset, tmp_path_factory.mktemp("rerank-run"),
                            on_epoch=lambda e, m: calls.append((e, m)), keep_model=True)
    return {"kind": kind, "cfg": cfg, "dataset": dataset, "result": result, "calls": calls}


def test_rrf_on_known_rankings() -> None:
    # b: 1/61 + 1/62, c: 1/62 + 1/63, a: 1/61, d: 1/63.
    fused = rrf([["a", "b", "c"], ["b", "c", "d"]])
    assert [d for d, _ in fused] == ["b", "c", "a", "d"]
    assert [s for _, s in fused] == pytest.approx([1 / 61 + 1 / 62, 1 / 62 + 1 / 63, 1 / 61, 1 / 63])
    assert rrf([["a", "b"], ["b"]], k=0) == [("b", 1.5), ("a", 1.0)]
    assert rrf([["x", "y"], ["y", "x"]], depth=1) == [("x", 1 / 61 + 1 / 62)]  # a tie goes to the smaller id
    runs = [{"q1": [("a", 9.0), ("b", 1.0)]}, {"q1": [("b", 0.9)], "q2": [("c", 0.1)]}]
    assert fuse_rankings(runs, k=1) == {"q1": [("b", 1 / 3 + 1 / 2), ("a", 1 / 2)], "q2": [("c", 1 / 2)]}
    with pytest.raises(ValueError):
        rrf([["a"]], k=-1)


def test_kind_is_found_through_the_entry_point() -> None:
    from lorafleet.core import wire
    from lorafleet.core.tasks import get_task_kind, task_kind_names
    from lorafleet.sidecar.runtime import runtime_class
    from lorafleet.train.kinds.rerank.kind import RerankKind

    assert "rerank" in task_kind_names()
    kind = get_task_kind("rerank")
    assert isinstance(kind, RerankKind) and kind.capability == wire.SCORE
    assert kind.capability in runtime_class(kind.default_runtime).capabilities
    assert (kind.metrics.objective, kind.metrics.headline, kind.metrics.direction) == \
        ("dev_ndcg@10", "test_ndcg@10", "maximize")
    details = kind.bundle_details(kind.parse_config({"first_stage": {"kind": "hybrid", "depth": 30}}))
    assert details["pipeline"]["first_stage"] == "hybrid" and details["pipeline"]["depth"] == 30
    assert details["pipeline"]["rrf_k"] == 60 and details["max_seq_length"] == 192
    # The gate: the better of the first stage alone and the fresh-head base reranker, not the base alone.
    assert kind.metrics.gate == "best"
    behind = kind.gate({"test_ndcg@10": 0.5, "base_test_ndcg@10": 0.2, "best_test_ndcg@10": 0.55,
                        "bestfirst_test_ndcg@10": 0.45}, None, 0.02)
    assert not behind.ok and "first stage" in behind.reasons[0]


def test_training_lowers_the_loss_and_reports_dev_only(trained: dict[str, Any]) -> None:
    from lorafleet.train.kinds.rerank.evaluate import load_reranker
    from lorafleet.train.kinds.rerank.trainer import listwise_loss

    result, cfg, calls = trained["result"], trained["cfg"], trained["calls"]
    assert [e for e, _ in calls] == [1, 2, 3, 4, 5]
    assert all("dev_ndcg@10" in m and "dev_recall@depth" in m for _, m in calls)
    assert result.metrics["dev_ndcg@10"] == calls[-1][1]["dev_ndcg@10"]
    assert {"first_dev_ndcg@10", "first_dev_mrr@10", "first_dev_recall@depth"} <= set(result.metrics)
    assert not [k for k in result.metrics if "test_" in k], "a trial must not score test"
    assert result.metrics["train_pairs"] == len(trained["dataset"].retrieval.queries["train"])

    groups = result.extras["groups"]
    assert all(len(negs) == 2 and pos not in negs for _, pos, negs in groups)
    before = listwise_loss(load_reranker(cfg.base_model, "cpu", cfg.max_pair_length), groups)
    after = listwise_loss(result.extras["model"], groups)
    # Measured on the sharpened tiny model: 1.0996 → 1.0483 (5 epochs of 6 steps); before is ln 3 (all alike).
    # How far it falls depends on the order of float sums (lr 5e-2 on a sharpened random model amplifies rounding):
    # alone with 1 torch thread 1.0985 → 1.0760, with 2 threads 1.0989 → 1.0616; in one full CI run of 9 (after
    # earlier tests in the same process) only 1.0987 → 1.0944. The bar asks for a clear fall, not its size.
    assert after < before - 0.002, (before, after)


def test_adapter_with_its_head_serves_identically(trained: dict[str, Any]) -> None:
    from lorafleet.core.config import BaseModelSpec
    from lorafleet.sidecar.ce_runtime import CrossEncoderRuntime

    result, cfg, dataset = trained["result"], trained["cfg"], trained["dataset"]
    adapter = result.adapter_dir
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["modules_to_save"] == ["classifier"] and saved["base_model_name_or_path"] == cfg.base_model
    data = dataset.retrieval
    pairs = [(q, c.text) for q in list(data.queries["test"].values())[:4] for c in list(data.corpus.values())[:5]]

    runtime = CrossEncoderRuntime(BaseModelSpec(name="tiny-ce", source=cfg.base_model, runtime="cross-encoder",
                                                max_seq_length=cfg.max_pair_length), device="cpu")
    runtime.load_adapter("reranker", str(adapter))
    want = result.extras["model"].predict([list(p) for p in pairs], show_progress_bar=False)
    np.testing.assert_allclose(runtime.score(pairs, "reranker"), want, rtol=0, atol=1e-5)
    assert not np.allclose(runtime.score(pairs, None), want, atol=1e-3), "the adapter changed nothing"

    # The kind's own evaluation (research's one look at test goes this way) reloads the same scores.
    dev = trained["kind"].evaluate(cfg, dataset, adapter, "dev")
    assert dev["dev_ndcg@10"] == pytest.approx(result.metrics["dev_ndcg@10"], abs=1e-9)
    assert dev["first_dev_ndcg@10"] == pytest.approx(result.metrics["first_dev_ndcg@10"], abs=1e-12)


class _Oracle:
    """A 'cross-encoder' that knows the answers: 1 for a relevant chunk, 0 otherwise (pure pipeline logic)."""

    def __init__(self, relevant: set[tuple[str, str]]) -> None:
        self.relevant = relevant

    def predict(self, pairs: list[list[str]], **_: Any) -> np.ndarray:
        return np.asarray([float((q, d) in self.relevant) for q, d in pairs])


def test_pipeline_reports_itself_beside_the_first_stage(trained: dict[str, Any]) -> None:
    from lorafleet.train.kinds.rerank.config import FirstStageSettings
    from lorafleet.train.kinds.rerank.evaluate import first_stage_ranking, pipeline_metrics
    from lorafleet.train.kinds.retrieval.evaluate import evaluate_bm25

    dataset, cfg = trained["dataset"], trained["cfg"]
    data = dataset.retrieval
    relevant = {(data.queries["dev"][q], c.text) for q, rel in data.qrels["dev"].items() for c in data.corpus.values()
                if c.section_id in rel}
    stage = FirstStageSettings(kind="bm25", depth=3)
    m = pipeline_metrics(_Oracle(relevant), dataset, stage, "dev")
    # The first stage alone is the project's BM25 evaluation, under the `first_` prefix.
    bm25 = evaluate_bm25(data, "dev")
    assert all(m[f"first_{k}"] == pytest.approx(v) for k, v in bm25.items())
    # An oracle reranker lifts every answer found in the top 3 to rank 1: nDCG@10 = MRR@10 = recall@depth.
    assert m["dev_ndcg@10"] == pytest.approx(m["dev_recall@depth"]) == pytest.approx(m["dev_mrr@10"])
    assert m["dev_ndcg@10"] >= m["first_dev_ndcg@10"] and m["dev_recall@depth"] == m["first_dev_recall@depth"]
    # Beyond the depth the first stage's order stands: recall@100 cannot change.
    assert m["dev_recall@100"] == pytest.approx(m["first_dev_recall@100"])

    hybrid = FirstStageSettings(kind="hybrid", embedder=cfg.first_stage.embedder, depth=3)
    fused = first_stage_ranking(dataset, hybrid, "dev")
    parts = [first_stage_ranking(dataset, hybrid.model_copy(update={"kind": k}), "dev") for k in ("bm25", "dense")]
    assert fused == fuse_rankings(parts, k=60, depth=100)


def test_research_over_pipelines_logs_to_mlflow(setup: tuple[Path, Path], tmp_path: Path,
                                                 _isolated_home: Path) -> None:
    import mlflow

    from lorafleet.core import settings
    from lorafleet.research.config import load_config
    from lorafleet.research.runner import run_research

    path = tmp_path / "rerank.yaml"
    path.write_text(yaml.safe_dump({
        "task": "rerank",
        "train": _train_raw(*setup, epochs=1),
        "research": {"study": "tiny-rerank", "n_trials": 2, "budget_minutes": 5, "trial_timeout_minutes": 3,
                     "sampler": {"kind": "random", "seed": 1}, "pruner": {"kind": "none"}, "min_margin": 0.0,
                     "reseed": False,
                     # The `train:` section's first stage is BM25, every trial's hybrid: the winner is judged
                     # against its own first stage (issue 39), not the `train:` section's.
                     "space": {"first_stage.kind": {"type": "categorical", "choices": ["hybrid"]},
                               "first_stage.depth": {"type": "categorical", "choices": [4, 8]},
                               "loss": {"type": "categorical", "choices": ["mnrl", "bce"]}}},
    }))
    result = run_research(load_config(path), progress_live=False)

    assert result.trials.get("complete") == 2 and result.winner_trial is not None, result.trials
    assert {"base_dev_ndcg@10", "base_test_ndcg@10", "first_dev_ndcg@10", "first_test_ndcg@10"} <= set(result.baseline)
    assert result.baseline["best_test_ndcg@10"] == max(result.baseline["base_test_ndcg@10"],
                                                       result.baseline["first_test_ndcg@10"])
    assert result.baseline["first_test_ndcg@10"] == pytest.approx(result.winner_metrics["first_test_ndcg@10"])
    assert result.baseline["bestfirst_test_ndcg@10"] >= result.baseline["first_test_ndcg@10"]
    assert "its own first stage alone" in result.verdict, result.verdict
    assert {"dev_ndcg@10", "test_ndcg@10", "test_mrr@10", "first_test_ndcg@10"} <= set(result.winner_metrics)
    mlflow.set_tracking_uri(settings.mlflow_tracking_uri())
    runs = mlflow.search_runs([result.experiment], output_format="list")
    assert len(runs) >= 3  # the study's parent run and both trials
    parent = next(r for r in runs if r.info.run_id == result.parent_run_id)
    assert "test_ndcg_at_10" in parent.data.metrics and "first_test_ndcg_at_10" in parent.data.metrics
