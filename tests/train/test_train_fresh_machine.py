"""The README's test command on a fresh machine: an empty HOME, no LORAFLEET_DATA_DIR, no LORAFLEET_HOME.

Offline, the tests that need the statutes are reported as not run, with one line that says how to provide
them; with a source to fetch from (here a local archive named by LORAFLEET_DATA_SOURCE, standing in for the
network), setup's data step fetches once and the same tests pass. Each session is a real pytest subprocess
on data-dependent test files, started in a fresh directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from test_train_data_fetch import public_archive

REPO = Path(__file__).resolve().parents[2]
# Statute tests found through the `data_dir` fixture, and CLI tests that hit "no statutes" inside a command.
FILES = ["tests/train/test_train_statutes.py", "tests/train/test_train_cli.py"]
NEEDS_DATA = 8  # of FILES' non-integration tests: 6 statute tests, 2 CLI cases that read laws
INSTRUCTION = "statutes not found"


def fresh_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORAFLEET_", "XDG_", "PYTEST_"))}
    return {**env, "HOME": str(home), **extra}


def pytest_session(cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "-m", "not integration", "--rootdir", str(REPO), *(str(REPO / f) for f in FILES)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def counts(out: str) -> dict[str, int]:
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped|failed|error|errors)\b", out)}


def test_offline_without_statutes_the_tests_that_need_them_are_not_run_and_one_line_says_why(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    run = pytest_session(tmp_path / "clone", fresh_env(home))
    out = run.stdout
    assert run.returncode == 0, out[-3000:]
    got = counts(out)
    assert got.get("skipped") == NEEDS_DATA and "failed" not in got and not {"error", "errors"} & set(got), out[-3000:]
    summary = [ln for ln in out.splitlines() if f"not run: {INSTRUCTION}" in ln]
    assert len(summary) == 1 and summary[0].startswith(f"{NEEDS_DATA} test(s) not run"), out[-3000:]
    assert "lorafleet data fetch" in summary[0] and "LORAFLEET_DATA_DIR" in summary[0]
    skips = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    assert skips and all(INSTRUCTION in ln for ln in skips)  # each is marked not run for that reason
    assert list(home.iterdir()) == []  # the session wrote nothing into the user's home


def test_with_a_source_setup_fetches_once_and_the_tests_pass(tmp_path: Path, data_dir: Path) -> None:
    setup = (REPO / "scripts" / "setup.sh").read_text()
    step = "lorafleet data fetch --if-missing"
    assert step in setup, "scripts/setup.sh fetches the statutes with this step"
    home = tmp_path / "home"
    env = fresh_env(home, LORAFLEET_DATA_SOURCE=str(public_archive(data_dir, tmp_path / "gesetze-master.tar.gz")))
    lf = [sys.executable, "-m", "lorafleet.cli", *step.split()[1:]]

    first = subprocess.run(lf, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and "(updated)" in first.stdout, first.stderr
    again = subprocess.run(lf, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "nothing fetched" in again.stdout, again.stderr  # fetched once
    assert (home / ".local" / "share" / "lorafleet" / "data" / "gesetze" / "bgb.md").is_file()

    run = pytest_session(tmp_path / "clone", env)
    got = counts(run.stdout)
    assert run.returncode == 0 and "skipped" not in got and got.get("passed", 0) >= NEEDS_DATA, run.stdout[-3000:]
    assert INSTRUCTION not in run.stdout
