"""lorafleet.train.tracking for any task kind: a standalone run logs its kind's headline metrics, its dataset,
and everything else as a table; the experiment gets the model-training kind, a description and the kind's
view. Driven here with the generation kind's names and a hand-made result (no training)."""

from __future__ import annotations

import base64
import json
import zlib
from pathlib import Path

import pandas as pd
import pytest

pytestmark = pytest.mark.integration  # a real (sqlite) MLflow store


class _Data:
    def __init__(self) -> None:
        self.digest = "c0ffee" * 8
        self.settings = {"laws": ["agg", "kschg"]}

    def summary(self) -> dict[str, int]:
        return {"train_examples": 40, "dev_examples": 6}

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame({"split": ["train", "dev"], "input": ["a", "b"], "heading": ["A", "B"]})


def test_a_generation_run_leads_with_its_headline(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from lorafleet.core import settings
    from lorafleet.core.tasks import TrainResult
    from lorafleet.train import tracking

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    data = _Data()
    with tracking.train_run("gen-run") as run:
        tracking.log_config(type("Cfg", (), {"model_dump": lambda self, mode: {"lr": 0.01}})(), "generation")
        tracking.log_dataset(data.to_frame(), tracking.dataset_name("generation", data), data.digest, data.summary())
        baselines = {"base_test_rouge_l": 0.3, "lead_test_rouge_l": 0.2, "base_test_chrf": 30.0}
        tracking.log_headline(baselines, "generation")  # all of them reach the table with the result's metrics
        tracking.log_epoch(1, {"dev_chrf": 35.0, "dev_rouge_l": 0.4}, "generation")
        result = TrainResult(adapter_dir=tmp_path / "adapter", dataset_digest=data.digest,
                             metrics={"dev_chrf": 35.0, "dev_rouge_l": 0.4, "test_rouge_l": 0.45, "test_chrf": 40.0,
                                      "test_exact_match": 0.1,
                                      **baselines},
                             epochs=[{"epoch": 1.0, "train_loss": 2.5, "dev_chrf": 35.0, "dev_rouge_l": 0.4}],
                             cost={"wall_s": 12.0, "cpu_s": 20.0, "peak_rss_mb": 900.0, "usd": 0.001})
        tracking.log_result(run, result, tmp_path, live_epochs=True)  # the kind comes from the run's tag

    client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri())
    logged = client.get_run(run.info.run_id)
    assert set(logged.data.metrics) == {"base_test_rouge_l", "lead_test_rouge_l", "dev_rouge_l", "test_rouge_l",
                                        "test_chrf", "test_exact_match", "train_loss", "cost_wall_s", "cost_usd"}
    assert [m.step for m in client.get_metric_history(run.info.run_id, "dev_rouge_l")] == [1]
    (dataset,) = logged.inputs.dataset_inputs
    assert dataset.dataset.name == "generation/agg+kschg" and dataset.dataset.digest == data.digest[:36]
    assert json.loads(dataset.dataset.profile)["train_examples"] == 40
    table = pd.read_json(client.download_artifacts(run.info.run_id, "metrics_table.json"), orient="split")
    assert {"base_test_chrf", "test_exact_match", "cost_peak_rss_mb", "dataset_train_examples"} <= set(
        table["name"]) and "dev_chrf" in set(table[table["step"] == 1]["name"])
    exp = client.get_experiment(logged.info.experiment_id)
    assert exp.name == "lorafleet-train" and exp.tags["mlflow.experimentKind"] == "custom_model_development"
    view = json.loads(exp.tags["mlflow.sharedViewState.lorafleet-generation"])
    state = json.loads(zlib.decompress(base64.b64decode(view["state"].removeprefix("deflate;"))))
    assert state["searchFilter"] == "tags.`lorafleet.task` = 'generation'"
    assert state["selectedColumns"][:4] == ["attributes.`Dataset`", "metrics.`test_rouge_l`",
                                            "metrics.`base_test_rouge_l`", "metrics.`lead_test_rouge_l`"]
