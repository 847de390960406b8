"""tests/reruns_plugin.py: every rerun is listed at the end of the run; a rerun of an unmarked test fails it.

Each case runs pytest in a subprocess on a generated test file whose tests fail on their first attempt only
(a count kept in a file), so the reruns are real pytest-rerunfailures reruns.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

_FLAKY_ONCE = '''
from pathlib import Path

import pytest


def _first_attempt(name: str) -> bool:
    seen = Path(__file__).with_name(name)
    first = not seen.exists()
    seen.touch()
    return first


@pytest.mark.flaky(reruns=2)  # the race: none, this test fails its first attempt on purpose
def test_marked() -> None:
    assert not _first_attempt("marked.seen")


def test_unmarked() -> None:
    assert not _first_attempt("unmarked.seen")


@pytest.mark.flaky(reruns=1)  # the race: none, this test always fails (a real defect fails every attempt)
def test_marked_broken() -> None:
    raise AssertionError("broken")


def test_steady() -> None:
    pass
'''


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_generated.py").write_text(_FLAKY_ONCE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the repo's settings
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "reruns_plugin", "-p", "no:cacheprovider",
                           "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), *args,
                           str(tmp_path / "test_generated.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_marked_test_rerun_passes_and_is_listed(tmp_path: Path) -> None:
    result = _pytest(tmp_path, "-k", "marked and not unmarked and not broken")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "RERUN x1 test_generated.py::test_marked: marked flaky (reruns=2), then passed" in result.stdout
    assert "1 passed" in result.stdout


def test_an_unmarked_test_rerun_fails_the_run_though_it_passed(tmp_path: Path) -> None:
    result = _pytest(tmp_path, "-k", "not broken", "--reruns", "1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "RERUN x1 test_generated.py::test_marked: marked flaky (reruns=2), then passed" in result.stdout
    assert "RERUN x1 test_generated.py::test_unmarked: NOT marked flaky, then passed" in result.stdout
    assert "1 test(s) not marked flaky were rerun, so the run fails" in result.stdout
    # Every test passed in the end: the rerun alone fails the run.
    assert "3 passed" in result.stdout and "failed" not in result.stdout.splitlines()[-1]


def test_no_rerun_says_so(tmp_path: Path) -> None:
    result = _pytest(tmp_path, "-k", "steady")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no test was rerun" in result.stdout


def test_a_marked_test_that_fails_every_attempt_is_listed_as_failed(tmp_path: Path) -> None:
    result = _pytest(tmp_path, "-k", "broken")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "RERUN x1 test_generated.py::test_marked_broken: marked flaky (reruns=1), then failed" in result.stdout
