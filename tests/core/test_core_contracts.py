"""Ground-floor contracts: overrides, fleet validation, queue layout, metric names, refs, plugins, task kinds."""

from __future__ import annotations

from typing import Any

import pytest

from lorafleet.core import plugins
from lorafleet.core.config import ConfigError, FleetConfig, QueueConfig, apply_overrides, validate_model
from lorafleet.core.metrics import flatten_params, from_mlflow_key, key, mlflow_key, mlflow_metrics, prefixed, to_test
from lorafleet.core.refs import parse_models_uri, parse_ref, version_uri
from lorafleet.core.tasks import MetricSpec, beats, get_task_kind, judge
from lorafleet.nats.queue import consumer_config, work_stream_config


def test_overrides_parse_yaml_values_and_create_sections() -> None:
    raw: dict[str, Any] = {"train": {"lora": {"r": 4}}}
    apply_overrides(raw, ["train.lora.r=16", "train.lora.target_modules=[q, v]", "research.study=x", "a=null"])
    assert raw == {"train": {"lora": {"r": 16, "target_modules": ["q", "v"]}}, "research": {"study": "x"}, "a": None}
    with pytest.raises(ConfigError, match="must look like key=value"):
        apply_overrides({}, ["train.epochs"])
    with pytest.raises(ConfigError, match="train is not a section"):
        apply_overrides({"train": 3}, ["train.epochs=2"])


def fleet(raw: dict[str, Any]) -> FleetConfig:
    return validate_model(FleetConfig, raw, source="fleet.yaml")


def test_fleet_validation_names_what_to_fix() -> None:
    with pytest.raises(ConfigError, match=r"bases.0.runtime: .*unknown runtime 'onnx'; installed runtimes: .*sentence"):
        fleet({"bases": [{"name": "m", "runtime": "onnx"}]})
    with pytest.raises(ConfigError, match="names base 'nope'"):
        fleet({"models": [{"name": "legal", "base": "nope", "adapter": "/x"}]})
    with pytest.raises(ConfigError, match="served name 'all-MiniLM-L6-v2' is used twice"):
        fleet({"models": [{"name": "all-MiniLM-L6-v2", "base": "all-MiniLM-L6-v2", "adapter": "/x"}]})
    with pytest.raises(ConfigError, match=r"worker.max_adaptors: unknown key \(check the spelling\)"):
        fleet({"worker": {"max_adaptors": 3}})


def test_consumer_config_follows_the_queue_settings() -> None:
    q = QueueConfig(ack_wait_s=2.0, max_deliver=4)
    c = consumer_config("all-MiniLM-L6-v2", q)
    assert c.durable_name == "workers-all-MiniLM-L6-v2" and c.filter_subject == "lorafleet.work.all-MiniLM-L6-v2"
    assert c.ack_policy is not None and c.ack_policy.value == "explicit"
    assert c.backoff == [2.0, 4.0, 8.0] and c.ack_wait == 2.0 and c.max_deliver == 4
    custom = consumer_config("b", QueueConfig(backoff_s=[1.0, 1.0], max_deliver=3))
    assert custom.backoff == [1.0, 1.0] and custom.ack_wait == 1.0
    with pytest.raises(ConfigError, match="backoff_s may not have more entries than max_deliver"):
        fleet({"queue": {"backoff_s": [1, 2, 3], "max_deliver": 2}})
    s = work_stream_config(q)
    assert s.retention is not None and s.retention.value == "workqueue"
    assert s.discard is not None and s.discard.value == "new"  # a full stream refuses, never drops old tasks


def test_metric_names_compose_by_prefix() -> None:
    assert key("test", "ndcg@10") == "test_ndcg@10" and to_test("dev_chrf") == "test_chrf"
    assert prefixed({"dev_chrf": 1.0}, "base") == {"base_dev_chrf": 1.0} and prefixed({"a": 1.0}, "") == {"a": 1.0}
    assert mlflow_key("base_test_ndcg@10") == "base_test_ndcg_at_10"
    assert from_mlflow_key(mlflow_key("test_recall@100")) == "test_recall@100"
    assert mlflow_metrics({"a@1": 1, "nan": float("nan"), "flag": True, "s": "x"}, "p_") == {"p_a_at_1": 1.0}
    flat = flatten_params({"lora": {"r": 8, "target_modules": ["query", "value"]}, "lr": 1e-3, "e": {}}, "train")
    assert flat == {"train.lora.r": "8", "train.lora.target_modules": '["query", "value"]', "train.lr": "0.001",
                    "train.e": "{}"}


def test_model_refs() -> None:
    assert parse_ref("legal/v3") == ("legal", "3", None) and parse_ref("legal@champion").ref == "champion"
    assert parse_ref("/some/path") is None and parse_ref("0" * 32) is None
    assert parse_models_uri("models:/legal/2").uri() == version_uri("legal", 2) == "models:/legal/2"
    with pytest.raises(ValueError, match="models:/NAME/VERSION"):
        parse_models_uri("models:/legal")


def test_margins_mean_one_thing() -> None:
    assert beats(0.42, 0.40, 0.05, "maximize") and not beats(0.4199, 0.40, 0.05, "maximize")
    assert beats(0.9, 1.0, 0.1, "minimize") and not beats(0.95, 1.0, 0.1, "minimize")
    spec = MetricSpec(objective="dev_loss", direction="minimize")
    verdict = judge(spec, {"test_loss": 1.2, "base_test_loss": 1.0}, {"test_loss": 1.1}, 0.0)
    assert not verdict.ok and len(verdict.reasons) == 2 and "above" in verdict.reasons[0]


def test_task_kinds_are_plugins() -> None:
    kind = get_task_kind("retrieval")
    assert kind.name == "retrieval" and kind.capability == "embed" and kind.metrics.headline == "test_ndcg@10"
    assert "retrieval" in plugins.names(plugins.TASK_KINDS)
    with pytest.raises(plugins.PluginError, match="unknown task kind 'chess'; known: "):
        get_task_kind("chess")


def test_duplicate_plugins_are_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    eps = [importlib.metadata.EntryPoint("x", "a.b:C", "lorafleet.test"),
           importlib.metadata.EntryPoint("x", "other.mod:D", "lorafleet.test")]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: eps)
    plugins._entries.cache_clear()
    try:
        with pytest.raises(plugins.PluginError, match="registered twice"):
            plugins.names("lorafleet.test")
    finally:
        plugins._entries.cache_clear()


def test_a_broken_plugin_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    eps = [importlib.metadata.EntryPoint("broken", "lorafleet.no_such_module:X", "lorafleet.test")]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: eps)
    plugins._entries.cache_clear()
    try:
        with pytest.raises(plugins.PluginError, match=r"'broken' .* failed to load: ModuleNotFoundError"):
            plugins.load("lorafleet.test", "broken")
    finally:
        plugins._entries.cache_clear()
