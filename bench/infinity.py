"""infinity-emb 0.0.78 as a contender: its own virtual environment, created on demand, and a server process.

Its pins clash with lorafleet's (it resolves to sentence-transformers 3.4.1 and transformers 4.57.6),
so it lives in a separate venv (default `bench/.venv-infinity`, ignored by git through a `.gitignore`
written inside it). The recipe is MEASURED.md's: torch 2.13.0 first, then infinity-emb under a
constraint that keeps that torch.

    python -m lorafleet.bench.infinity [--venv DIR]     # create the venv now (a few minutes)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

INFINITY_VERSION = "0.0.78"
TORCH_VERSION = "2.13.0"
DEFAULT_VENV = Path(__file__).resolve().parent / ".venv-infinity"


class InfinityUnavailable(RuntimeError):
    """infinity-emb cannot run here; the message says exactly why."""


def venv_dir() -> Path:
    return Path(os.environ.get("LORAFLEET_INFINITY_VENV", str(DEFAULT_VENV)))


def infinity_bin(venv: Path) -> Path:
    return venv / "bin" / "infinity_emb"


def ensure_venv(venv: Path | None = None, say=print) -> Path:  # type: ignore[no-untyped-def]
    """The infinity_emb executable, installing the venv first when it is missing (progress on stderr)."""
    venv = venv or venv_dir()
    exe = infinity_bin(venv)
    if exe.exists() and (venv / ".complete").exists():
        return exe
    say(f"infinity-emb {INFINITY_VERSION} is not installed: creating its own venv at {venv} "
        "(torch + infinity-emb from the package index; a few minutes, once)")
    venv.mkdir(parents=True, exist_ok=True)
    (venv / ".gitignore").write_text("*\n")
    pip = venv / "bin" / "pip"
    log = venv / "install.log"
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(pip), "install", "-q", f"torch=={TORCH_VERSION}"],
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as cons:
        cons.write(f"torch=={TORCH_VERSION}\n")
    steps.append([str(pip), "install", "-q", "-c", cons.name, f"infinity-emb[server,torch]=={INFINITY_VERSION}"])
    t0 = time.monotonic()
    try:
        with open(log, "a") as fh:
            for argv in steps:
                say("  $ " + " ".join(Path(a).name if i == 0 else a for i, a in enumerate(argv)))
                rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
                if rc != 0:
                    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                    raise InfinityUnavailable(f"installing infinity-emb failed at `{' '.join(argv[-3:])}` "
                                              f"(exit {rc}); see {log}:\n{tail}")
    finally:
        os.unlink(cons.name)
    (venv / ".gitignore").write_text("*\n")
    if not exe.exists():
        raise InfinityUnavailable(f"the install finished but {exe} does not exist; see {log}")
    (venv / ".complete").write_text(f"infinity-emb {INFINITY_VERSION}\n")
    say(f"  infinity-emb installed in {time.monotonic() - t0:.0f}s")
    return exe


def server_argv(exe: Path, model_dir: str, port: int, batch_size: int = 32, dtype: str | None = None) -> list[str]:
    """`dtype`: infinity's --dtype (its CLI offers float32, float16, bfloat16, int8, fp8, auto); None: its default."""
    # --help shows disk cache and compile as defaults; both are off in its code (MEASURED.md). Be explicit anyway.
    return [str(exe), "v2", "--model-id", model_dir, "--served-model-name", "all-MiniLM-L6-v2", "--engine", "torch",
            "--device", "cpu", "--batch-size", str(batch_size), "--no-vector-disk-cache", "--host", "127.0.0.1",
            "--port", str(port), *(["--dtype", dtype] if dtype else [])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lorafleet.bench.infinity",
                                description="Create the separate venv with infinity-emb 0.0.78 used by bench/serve.py.")
    p.add_argument("--venv", type=Path, default=None,
                   help=f"Where (default {DEFAULT_VENV}, or $LORAFLEET_INFINITY_VENV).")
    args = p.parse_args(argv)
    try:
        exe = ensure_venv(args.venv, say=lambda s: print(s, file=sys.stderr, flush=True))
    except InfinityUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(exe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
