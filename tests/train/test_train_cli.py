"""`lorafleet train`: bad input exits non-zero with a clear message; a short real run logs to MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lorafleet.cli import app

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "german-legal.yaml"


def _run(*args: str):
    return CliRunner().invoke(app, ["train", str(CONFIG), *args])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "data.laws=[kschg,nolaw]"], "unknown law 'nolaw'; available: agg"),
        (["--set", "lora.rnk=4"], "lora.rnk: unknown key"),
        (["--set", "lora.r=0"], "lora.r: Input should be greater than 0"),
        (["--set", "data.laws=[prodhaftg]", "--set", "data.test_fraction=0.01"], "no test queries"),
        (["--set", "epochs"], "must look like key=value"),
    ],
)
def test_bad_input_exits_with_message(args: list[str], message: str) -> None:
    result = _run(*args, "--no-mlflow")
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_missing_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORAFLEET_DATA_DIR", str(tmp_path / "nowhere"))
    result = _run("--no-mlflow")
    assert result.exit_code == 2 and "LORAFLEET_DATA_DIR" in result.output


def test_empty_corpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "gesetze").mkdir()
    (tmp_path / "gesetze" / "leer.md").write_text("# Leer\n\n## § 1 (weggefallen)\n")
    monkeypatch.setenv("LORAFLEET_DATA_DIR", str(tmp_path))
    result = _run("--set", "data.laws=[leer]", "--no-mlflow")
    assert result.exit_code == 2 and "empty corpus" in result.output


def test_help() -> None:
    result = CliRunner().invoke(app, ["train", "--help"])
    assert result.exit_code == 0 and "--set" in result.output


@pytest.mark.integration
def test_short_run_logged_to_mlflow(tmp_path: Path) -> None:
    import mlflow
    import pandas as pd

    from lorafleet.core import settings
    from lorafleet.core.metrics import mlflow_key
    from lorafleet.core.tasks import get_task_kind
    from lorafleet.train.kinds.retrieval.evaluate import METRICS

    out = tmp_path / "run"
    result = _run(
        "--out", str(out), "--run-name", "itest",
        "--set", "data.laws=[kschg,prodhaftg]", "--set", "epochs=1", "--set", "batch_size=8",
        "--set", "data.max_train_queries=24", "--set", "data.max_eval_queries=10",
        "--set", "data.max_chunks_per_section=2",
    )
    assert result.exit_code == 0, result.output
    assert "test nDCG@10: BM25" in result.output

    saved = json.loads((out / "metrics.json").read_text())
    metrics = saved["metrics"]
    for split in ("dev", "test"):
        for name in METRICS:
            for prefix in ("", "base_", "bm25_"):
                assert 0 <= metrics[f"{prefix}{split}_{name}"] <= 1
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert "| ndcg@10 |" in (out / "report.md").read_text()
    assert set(saved["cost"]) == {"wall_s", "cpu_s", "peak_rss_mb", "usd"}

    mlflow.set_tracking_uri(settings.mlflow_tracking_uri())
    assert settings.mlflow_tracking_uri().startswith("sqlite:///" + str(settings.home()))
    runs = mlflow.search_runs(experiment_names=["lorafleet-train"], output_format="pandas")
    assert len(runs) == 1
    run = runs.iloc[0]
    assert run["tags.mlflow.runName"] == "itest" and run["status"] == "FINISHED"
    assert run["metrics.test_ndcg_at_10"] == pytest.approx(metrics["test_ndcg@10"])
    assert run["metrics.base_test_ndcg_at_10"] == pytest.approx(metrics["base_test_ndcg@10"])
    # Only the kind's headline set (and the loss curve) are MLflow metrics; the long tail is the run's table.
    logged = {c.removeprefix("metrics.") for c in runs.columns if c.startswith("metrics.") and runs[c].notna().all()}
    assert logged <= {mlflow_key(m) for m in get_task_kind("retrieval").metrics.headline_set} | {"train_loss"}
    assert "bm25_dev_map_at_100" not in logged and {"test_ndcg_at_10", "bm25_test_ndcg_at_10", "cost_usd"} <= logged
    assert run["params.lora.r"] == "16"
    assert run["params.data.laws"] == '["kschg", "prodhaftg"]'  # JSON, as research logs it
    assert run["tags.dataset_digest"] == saved["dataset_digest"]

    client = mlflow.MlflowClient()
    full = client.get_run(run["run_id"])
    inputs = full.inputs.dataset_inputs
    assert len(inputs) == 1 and inputs[0].dataset.digest == saved["dataset_digest"][:36]
    history = client.get_metric_history(run["run_id"], "dev_ndcg_at_10")
    assert [m.step for m in history] == [1] and history[0].value == pytest.approx(metrics["dev_ndcg@10"])
    artifacts = {a.path for a in client.list_artifacts(run["run_id"])}
    assert {"adapter", "report.md", "metrics.json", "metrics_table.json"} <= artifacts
    table = pd.read_json(client.download_artifacts(run["run_id"], "metrics_table.json"), orient="split")
    tail = {(r.name, r.step if r.step == r.step else None): r.value for r in table.itertuples()}
    assert tail[("bm25_dev_map@100", None)] == pytest.approx(metrics["bm25_dev_map@100"])
    assert tail[("dev_mrr@10", 1)] == pytest.approx(metrics["dev_mrr@10"])  # per epoch
    assert ("dataset_train_queries", None) in tail
    assert {a.path for a in client.list_artifacts(run["run_id"], "adapter")} >= {
        "adapter/adapter_config.json", "adapter/adapter_model.safetensors"
    }
