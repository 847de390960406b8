"""`lorafleet tune` of a reranker: the score sweep on a real private cluster (nats-server, gateway, one worker with
the cross-encoder runtime), a tiny random BERT with a LoRA that saves its head; and its pure parts."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lorafleet.core.config import ServingProfile
from lorafleet.tune.config import TuneConfig
from lorafleet.tune.kinds.rerank.kind import is_score
from lorafleet.tune.kinds.rerank.load import rerank_bodies
from lorafleet.tune.source import from_adapter_dir


def _ce_adapter(base: Path, out: Path) -> Path:
    """A SEQ_CLS LoRA of the tiny BERT as a cross-encoder, its classifier head saved with it (what `rerank` trains)."""
    from lorafleet.sidecar.ce_runtime import load_cross_encoder
    from lorafleet.testing import add_random_ce_adapter

    model = load_cross_encoder(str(base))
    add_random_ce_adapter(model, "tiny-ce", r=4, seed=3, scale=0.1)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def ce_adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _ce_adapter(tiny_model_dir, tmp_path_factory.mktemp("ce-adapter") / "tiny-ce")


def test_is_score_tells_a_cross_encoder_lora_from_an_embedding_one(ce_adapter_dir: Path, tiny_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    from lorafleet.testing import make_random_adapter

    assert is_score(from_adapter_dir(ce_adapter_dir, str(tiny_model_dir)))
    embed = make_random_adapter(tiny_model_dir, tmp_path / "embed-lora", seed=1)
    assert not is_score(from_adapter_dir(embed, str(tiny_model_dir)))


def test_rerank_bodies_are_one_query_and_n_documents() -> None:
    texts = [f"Satz Nummer {i} über den Kaufpreis und die Lieferung der Sache." for i in range(30)]
    bodies = [json.loads(b) for b in rerank_bodies(texts, 50, n=4, seed=1)]
    assert len(bodies) == 4 and all(len(b["documents"]) == 50 and b["query"] and b["model"] for b in bodies)
    assert bodies == [json.loads(b) for b in rerank_bodies(texts, 50, n=4, seed=1)]  # seeded: every profile alike


def test_quick_preset_sweeps_the_token_budget() -> None:
    q = TuneConfig.quick_preset()
    assert q.rerank_tokens_grid and q.rerank_concurrencies == [8] and q.rerank_documents == 50


@pytest.mark.integration
def test_tune_quick_cli_sweeps_the_score_profile(ce_adapter_dir: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    from lorafleet.cli import app

    out = tmp_path / "tune-out"
    result = CliRunner().invoke(app, ["tune", str(ce_adapter_dir), "--base", str(tiny_model_dir), "--quick",
                                      "--budget-s", "600", "--out", str(out)])  # a loaded machine still sweeps
    assert result.exit_code == 0, result.output
    assert "1 query × 50 documents" in result.output and "pairs/s" in result.output
    profile = ServingProfile.model_validate(yaml.safe_load((out / "profile.yaml").read_text()))
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert rows[0]["phase"] == "baseline" and [r["phase"] for r in rows[1:]] == ["tokens"]
    assert rows[1]["max_batch_tokens"] == str(TuneConfig.quick_preset().rerank_tokens_grid[0])
    for r in rows:  # every rerank request answered; pairs/s = requests/s × 50 documents
        assert r["errors"] == "0" and float(r["p99_ms"]) > 0
        # both columns are rounded (requests/s to 0.01, which ×50 is 0.25 pairs/s)
        assert float(r["pairs_per_s"]) == pytest.approx(float(r["throughput_rps"]) * 50, abs=0.5)
    rec = next(r for r in rows if r["recommended"] == "True")
    assert int(rec["max_batch_tokens"]) == profile.max_batch_tokens
    data = json.loads((out / "results.json").read_text())
    assert data["precisions"][0]["precision"] == "fp32" and data["recommended"]["pairs_per_s"] > 0
    assert not (out / ".work").exists()


@pytest.mark.integration
def test_ship_tunes_and_registers_a_rerank_winner(ce_adapter_dir: Path, tiny_model_dir: Path,
                                                  _isolated_home: Path) -> None:
    """`research run` ships a rerank winner (no `--no-ship`): the score sweep tunes it, and the bundle names the
    fleet's cross-encoder base (`<base>-ce`, as configs/fleet.yaml serves the packaged MiniLM's)."""
    import mlflow

    from lorafleet import pipeline
    from lorafleet.registry import store
    from lorafleet.research.result import ResearchResult

    mlflow.set_tracking_uri(store.tracking_uri())
    # An experiment of this store: mlflow's process-wide active experiment may still be an earlier test's id.
    experiment = mlflow.set_experiment("tiny-rerank")
    with mlflow.start_run(experiment_id=experiment.experiment_id) as run:  # the study's parent run (holds the bundle)
        parent = run.info.run_id
    winner = {"base_model": str(tiny_model_dir), "first_stage": {"kind": "bm25", "depth": 5},
              "max_seq_length": 32, "max_pair_length": 48, "device": "cpu"}
    result = ResearchResult(study="tiny-rerank", storage="", experiment="", parent_run_id=parent,
                            objective="dev_ndcg@10", task="rerank", winner_trial=0, winner_config=winner,
                            winner_adapter_dir=str(ce_adapter_dir), winner_metrics={"test_ndcg@10": 0.5},
                            candidate=True, finalized=True)
    shipped = pipeline.ship(result, tune_quick=True, say=lambda _: None)
    assert shipped is not None and shipped.profile_source == "tuned" and shipped.tune_dir is not None
    _, spec = store.bundle_spec(shipped.ref.name, shipped.ref.version)
    assert spec.base.name == "tiny-bert-ce" and spec.runtime == "cross-encoder" and spec.task == "rerank"
    assert spec.profile == shipped.profile and spec.details["pipeline"]["first_stage"] == "bm25"
