"""`lorafleet tune --quick` end to end on a real private cluster (nats-server, gateway, worker), tiny model."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lorafleet.core.config import ServingProfile

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorafleet.testing import make_random_adapter

    return make_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter") / "tiny-lora", seed=5)


def test_tune_quick_cli(tiny_adapter_dir: Path, tmp_path: Path) -> None:
    from lorafleet.cli import app

    out = tmp_path / "tune-out"
    result = CliRunner().invoke(app, ["tune", str(tiny_adapter_dir), "--quick", "--slo-p99-ms", "5000", "--out",
                                      str(out)])
    assert result.exit_code == 0, result.output
    profile = ServingProfile.model_validate(yaml.safe_load((out / "profile.yaml").read_text()))
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert 2 <= len(rows) <= 3
    assert rows[0]["phase"] == "baseline" and rows[0]["max_batch_items"] == "32"
    assert [r["recommended"] for r in rows].count("True") == 1
    rec = next(r for r in rows if r["recommended"] == "True")
    assert int(rec["max_batch_items"]) == profile.max_batch_items
    for r in rows:
        assert float(r["throughput_rps"]) > 0 and float(r["p99_ms"]) > 0 and float(r["peak_rss_mb"]) > 50
        assert r["errors"] == "0"
    data = json.loads((out / "results.json").read_text())
    assert data["recommended"]["meets_slo"] is True
    assert data["front"] and all(p["points"] for p in data["profiles"])
    assert (out / "throughput_p99.png").stat().st_size > 10_000
    assert not (out / ".work").exists()


def test_tune_bad_source(tmp_path: Path) -> None:
    from lorafleet.cli import app

    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(app, ["tune", str(tmp_path / "empty"), "--quick"])
    assert r.exit_code == 1 and "neither a peft adapter folder" in r.output
    r = CliRunner().invoke(app, ["tune", str(tmp_path / "missing"), "--quick"])
    assert r.exit_code == 1 and "does not exist" in r.output
    r = CliRunner().invoke(app, ["tune", "nosuch@candidate", "--quick"])
    assert r.exit_code == 1 and "no registered model named 'nosuch'" in r.output
