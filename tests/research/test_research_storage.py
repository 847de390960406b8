"""Remote stores, the parts that need no server: a missing database driver says what to install; experiments
take a local artifact root only for a store on this machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

URL = "postgresql+psycopg://optuna:s3cret@127.0.0.1:1/optuna"


def test_missing_postgres_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                 research_yaml: object) -> None:
    from lorafleet.cli import app

    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if the postgres extra were not installed
    config = research_yaml("pg")  # type: ignore[operator]
    out = CliRunner().invoke(app, ["research", "run", str(config), "--storage", URL, "--plain"])
    assert out.exit_code == 2, out.output
    assert "needs psycopg, which is not installed" in out.output
    assert "pip install 'lorafleet[postgres]'" in out.output
    assert "s3cret" not in out.output, "the password is never printed"


def test_unreachable_storage_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafleet.research.config import ResearchConfig
    from lorafleet.research.study import StudyError, make_storage

    monkeypatch.setattr("time.sleep", lambda s: None)  # the retries are for racing table creation, not this
    cfg = ResearchConfig.model_validate({"study": "s", "space": {"learning_rate": {"type": "float", "low": 1e-4,
                                                                                   "high": 1e-2}}})
    with pytest.raises(StudyError, match=r"cannot open Optuna storage postgresql\+psycopg://optuna:\*\*\*@") as err:
        make_storage(URL, cfg, None)
    assert "s3cret" not in str(err.value)


def test_artifact_root_only_for_a_local_store(monkeypatch: pytest.MonkeyPatch, _isolated_home: Path) -> None:
    from lorafleet.core import settings

    root = settings.mlflow_artifact_root("bundles")
    assert root == (_isolated_home / "mlflow" / "artifacts").as_uri() + "/bundles" and not settings.mlflow_remote()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{_isolated_home / 'other.db'}")
    assert settings.mlflow_artifact_root() == (_isolated_home / "mlflow" / "artifacts").as_uri()
    for uri in ("http://mlflow.internal:5000", "HTTPS://mlflow.example.org"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        assert settings.mlflow_remote() and settings.mlflow_artifact_root("bundles") is None
