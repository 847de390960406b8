"""Process control of the benchmarks: children in their own sessions that die with the benchmark, stopped
together, and SIGTERM turned into SystemExit so that `finally` blocks run."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any


def _die_with_parent() -> None:
    """preexec_fn: own session (so stopping it stops its children), and SIGTERM when the benchmark dies.

    A benchmark killed mid-run (a CI timeout) must not leave workers behind.
    """
    import ctypes
    import signal

    os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Any:
    """Start a child in its own session that is terminated if this process dies; output to `log`."""
    import subprocess

    with open(log, "ab") as fh:
        return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, preexec_fn=_die_with_parent)


def stop_all(procs: list[Any], timeout: float = 5.0) -> None:
    """SIGTERM every process group at once, SIGKILL whatever still runs after `timeout` seconds."""
    import signal

    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            p.wait(timeout=5)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that `finally` blocks stop every server the benchmark started."""
    import signal

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
