"""Fixture for the benchmark smoke tests: run one benchmark's `--quick` mode and read its JSON.

The smoke tests assert only that a benchmark finishes and writes well-formed results; a shared
CI machine is too noisy to judge figures (the full runs are in docs/benchmarks.md).
"""

from __future__ import annotations

import json
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
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, (f"bench {module} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
                                      f"{proc.stderr[-3000:]}")
        assert out.is_file(), f"bench {module} wrote no {out}"
        data = json.loads(out.read_text())
        assert data["benchmark"] == module and data["quick"] is True
        assert f"wrote {out}" in proc.stdout  # the table was printed to the end
        return data

    return run
