"""deploy/grafana/lorafleet.json and the code cannot drift: every series its PromQL reads is one the gateway or a
worker exports (name and suffix: `_total` of a counter, `_bucket`/`_sum`/`_count` of a histogram)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from lorafleet.serve import metrics as gateway_metrics
from lorafleet.serve.metrics import GatewayMetrics
from lorafleet.sidecar import metrics as worker_metrics
from lorafleet.sidecar.metrics import WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "lorafleet.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_series() -> set[str]:
    """Every sample name the two registries can expose, from their families' types."""
    out: set[str] = set()
    for registry in (GatewayMetrics(lambda: 0.0).registry, WorkerMetrics(["b"]).registry):
        for family in registry.collect():
            out.update(family.name + s for s in _SUFFIXES[family.type])
    return out


def exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_every_metric_in_the_dashboard_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for e in exprs(dashboard) for name in re.findall(r"\blorafleet_[a-z_]+", e)}
    assert len(used) >= 15, used  # the panels named in the issue: routes, lag, outcomes, batches, adapters
    missing = used - exported_series()
    assert not missing, f"the dashboard reads series nobody exports: {sorted(missing)}"


def test_the_dashboard_covers_the_autoscaling_and_worker_series() -> None:
    text = DASHBOARD.read_text()
    for name in (gateway_metrics.CONSUMER_LAG, gateway_metrics.BACKLOG, gateway_metrics.REQUEST_SECONDS,
                 *worker_metrics.NAMES):
        assert name in text, f"no panel shows {name}"


def test_panels_use_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
