"""What MLflow shows first, as pure functions: each kind's headline set, its sentence, the long tail as rows,
lorafleet's saved runs view, a model version's tags and description, and the links `lorafleet ui` prints."""

from __future__ import annotations

import base64
import json
import zlib
from pathlib import Path

import pytest

from lorafleet.core.tasks import COST_HEADLINE, MetricSpec, get_task_kind


def test_headline_set_comes_from_the_kind() -> None:
    retrieval = get_task_kind("retrieval").metrics
    assert retrieval.headline_set == ("test_ndcg@10", "base_test_ndcg@10", "bm25_test_ndcg@10", "dev_ndcg@10",
                                      "base_dev_ndcg@10", "bm25_dev_ndcg@10", *COST_HEADLINE)
    generation = get_task_kind("generation").metrics
    assert generation.headline_set[:5] == ("test_rouge_l", "base_test_rouge_l", "lead_test_rouge_l",
                                           "best_test_rouge_l", "dev_rouge_l")
    assert MetricSpec(objective="dev_loss").headline_set == ("test_loss", "base_test_loss", "dev_loss",
                                                             "base_dev_loss", *COST_HEADLINE)


def test_summary_states_the_headline_in_words() -> None:
    retrieval = get_task_kind("retrieval").metrics
    metrics = {"test_ndcg@10": 0.44, "base_test_ndcg@10": 0.315, "bm25_test_ndcg@10": 0.298}
    assert retrieval.summary(metrics) == "test nDCG@10 0.440 vs base 0.315 (+40 %) and BM25 0.298"
    assert retrieval.summary({"test_ndcg@10": 0.44}) == "test nDCG@10 0.440"
    assert retrieval.summary({"dev_ndcg@10": 0.4}) is None
    rouge = get_task_kind("generation").metrics.summary({"test_rouge_l": 0.441, "base_test_rouge_l": 0.302})
    assert rouge == "test ROUGE-L 0.441 vs base 0.302 (+46 %)"


def test_rows_split_names_into_model_split_metric() -> None:
    rows = get_task_kind("retrieval").metrics.rows(
        {"bm25_test_ndcg@10": 0.3, "dev_heading_ndcg@10": 0.2, "cost_usd": 0.01, "flag": True}, step=2)
    assert [(r["name"], r["model"], r["split"], r["metric"], r["step"]) for r in rows] == [
        ("bm25_test_ndcg@10", "bm25", "test", "ndcg@10", 2), ("dev_heading_ndcg@10", "adapter", "dev",
                                                               "heading_ndcg@10", 2),
        ("cost_usd", "adapter", "", "cost_usd", 2)]


def _state(tag: str) -> dict:
    envelope = json.loads(tag)
    assert envelope["name"] and isinstance(envelope["createdAt"], int)
    return json.loads(zlib.decompress(base64.b64decode(envelope["state"].removeprefix("deflate;"))))


def test_runs_view_leads_with_the_headline() -> None:
    from lorafleet.research.tracking import runs_view, view_tag

    spec = get_task_kind("retrieval").metrics
    state = _state(view_tag("lorafleet", runs_view(spec, tag_columns=("lorafleet.trial_state",),
                                                   param_columns=("learning_rate",), group_by_tag="lorafleet.study")))
    assert state["selectedColumns"] == state["columnOrder"] == [
        "attributes.`Dataset`", "metrics.`test_ndcg_at_10`", "metrics.`base_test_ndcg_at_10`",
        "metrics.`bm25_test_ndcg_at_10`", "metrics.`dev_ndcg_at_10`", "metrics.`cost_usd`",
        "tags.`lorafleet.trial_state`", "params.`learning_rate`"]
    assert state["orderByKey"] == "metrics.`dev_ndcg_at_10`" and state["orderByAsc"] is False
    assert state["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "lorafleet.study"}]
    assert [c["metricKey"] for c in state["compareRunCharts"]][:3] == [
        "test_ndcg_at_10", "base_test_ndcg_at_10", "bm25_test_ndcg_at_10"]


def test_version_tags_and_description() -> None:
    from lorafleet.registry.store import version_description, version_tags

    spec = get_task_kind("retrieval").metrics
    metrics = {"test_ndcg@10": 0.44, "base_test_ndcg@10": 0.315, "bm25_test_ndcg@10": 0.298, "dev_ndcg@10": 0.41,
               "base_dev_ndcg@10": 0.3, "test_mrr@10": 0.5, "test_recall@100": 0.9}
    assert version_tags(spec, metrics) == {"test_ndcg_at_10": "0.44", "base_test_ndcg_at_10": "0.315",
                                           "bm25_test_ndcg_at_10": "0.298", "dev_ndcg_at_10": "0.41",
                                           "test_ndcg_gain": "0.125"}
    assert version_description(spec, metrics, "all-MiniLM-L6-v2", "3f2a1b9c0d1e2f3a", "candidate: …") == (
        "test nDCG@10 0.440 vs base 0.315 (+40 %) and BM25 0.298; LoRA on all-MiniLM-L6-v2, trained on dataset "
        "3f2a1b9c0d1e.\n\ncandidate: …")
    assert version_description(spec, {}, "m", None) == "LoRA on m (no test metrics recorded)."


@pytest.mark.integration  # a real (sqlite) MLflow store
def test_ui_links_name_each_study_view_and_model(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from lorafleet.cli.registry import ui_links
    from lorafleet.research.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker("legal", tracking_uri=uri)
    tracker.describe("retrieval", get_task_kind("retrieval").metrics, params=("learning_rate",))
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("legal")
    links = dict(ui_links("http://127.0.0.1:5000", uri))
    exp = tracker.experiment_id
    assert links == {
        "runs of lorafleet-research/legal":
            f"http://127.0.0.1:5000/#/experiments/{exp}/runs?workflowType=machine_learning&viewStateShareKey=lorafleet",
        "model legal": "http://127.0.0.1:5000/#/models/legal?workflowType=machine_learning",
    }
    assert client.get_experiment(exp).tags["mlflow.experimentKind"] == "custom_model_development"
