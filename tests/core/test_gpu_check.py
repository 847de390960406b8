"""scripts/gpu-check.sh on a machine without CUDA: a clear message, a summary JSON, exit 0, nothing installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"
BASH = shutil.which("bash") or "/bin/bash"


def run(out: Path, path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path}
    env.pop("OUT", None)
    return subprocess.run([BASH, str(SCRIPT), str(out)], capture_output=True, text=True, env=env, timeout=30)


def test_without_nvidia_smi_it_says_so_and_exits_zero(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("date", "mkdir", "cat", "head", "awk", "tr", "timeout", "dirname"):  # what it runs before the check
        found = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if found:
            (bare / tool).symlink_to(found)
    proc = run(tmp_path / "out", str(bare))
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device here" in proc.stdout and "nvidia-smi" in proc.stdout
    summary = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert summary["cuda"] is False and summary["steps"] == [] and "no CUDA device" in summary["message"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu-check.json"]  # nothing ran, nothing installed


def test_a_driver_that_lists_no_gpu_is_no_cuda_either(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver' >&2\n"
                   "exit 9\n")
    smi.chmod(0o755)
    proc = run(tmp_path / "out", f"{fake}:{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stderr
    assert "nvidia-smi lists no GPU" in proc.stdout
    assert json.loads((tmp_path / "out" / "gpu-check.json").read_text())["cuda"] is False


@pytest.mark.skipif(subprocess.run(["bash", "-c", "command -v nvidia-smi"], capture_output=True).returncode == 0,
                    reason="this machine has nvidia-smi: the no-CUDA path is simulated above")
def test_this_machine_has_no_cuda(tmp_path: Path) -> None:
    proc = run(tmp_path / "out", os.environ["PATH"])
    assert proc.returncode == 0 and "no CUDA device here" in proc.stdout
