"""Fixture for the benchmark smoke tests: run one benchmark's `--quick` mode and read its JSON.

The smoke tests assert only that a benchmark finishes and writes well-formed results; a shared
CI machine is too noisy to judge figures (the full runs are in docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

RunQuick = Callable[..., dict[str, Any]]


@pytest.fixture
def run_quick(tmp_path: Path) -> RunQuick:
    def run(module: str, *extra: str, timeout: float = 120) -> dict[str, Any]:
        out = tmp_path / f"{module}.json"
        argv = [sys.executable, "-m", f"lorafleet.bench.{module}", "--quick", "--out", str(out), *extra]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM first: the benchmark then stops every server it started; SIGKILL only after that.
            proc.terminate()
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
            pytest.fail(f"bench {module} did not finish within {timeout:.0f}s:\n{stdout[-2000:]}\n{stderr[-3000:]}")
        assert proc.returncode == 0, f"bench {module} exited {proc.returncode}:\n{stdout[-2000:]}\n{stderr[-3000:]}"
        assert out.is_file(), f"bench {module} wrote no {out}"
        data = json.loads(out.read_text())
        assert data["benchmark"] == module and data["quick"] is True
        assert f"wrote {out}" in stdout  # the table was printed to the end
        return data

    return run
