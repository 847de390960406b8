"""Real remote stores for the tests, on loopback: an MLflow tracking server with proxied artifacts and a
PostgreSQL cluster from the Debian packages. Each runs in its own process group, started and stopped here."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from lorafleet.nats.server import free_port
from lorafleet.ops.processes import stop_group

REPO = Path(__file__).resolve().parents[2]
# The research tests' tiny study (tiny random BERT, one short law) and CLI environment, reused as they are.
sys.path.insert(0, str(REPO / "tests" / "research"))
from research_testkit import cli_env, tiny_config  # noqa: E402

__all__ = ["REPO", "cli_env", "mlflow_server", "pg_bin", "pg_user", "postgres_server", "tiny_config"]

PG_BIN_ROOT = Path("/usr/lib/postgresql")
PG_USER = "nobody"  # initdb refuses to run as root: then the cluster runs as this user


def _wait_ready(proc: subprocess.Popen[bytes], log: Path, probe: Callable[[], bool], what: str, timeout: float
                ) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready within {timeout:.0f}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


@contextlib.contextmanager
def mlflow_server(root: Path, timeout: float = 120.0) -> Iterator[str]:
    """`mlflow server --serve-artifacts`: sqlite backend and artifact folder under `root`; yields its URL."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = root / "mlflow-server.log"
    argv = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--serve-artifacts",
            "--artifacts-destination", str(root / "artifacts")]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1",
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait_ready(proc, log, healthy, "mlflow server", timeout)
        yield url
    finally:
        stop_group(proc.pid, 10.0, "mlflow")


def pg_bin() -> Path | None:
    """The newest PostgreSQL server binaries of the Debian packages (postgresql-NN), or None."""
    found = sorted((p for p in PG_BIN_ROOT.glob("*/bin") if (p / "initdb").is_file() and (p / "postgres").is_file()),
                   key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    return found[-1] if found else None


def pg_user() -> str | None:
    """Who runs the cluster: the current user, or as root (initdb refuses root) `nobody`; KeyError if that is
    missing. No user is created: the test leaves the machine's accounts as they were."""
    if os.geteuid() != 0:
        return None
    pwd.getpwnam(PG_USER)
    return PG_USER


def _as(user: str | None, argv: list[str]) -> list[str]:
    return ["runuser", "-u", user, "--", *argv] if user else argv


def _run(argv: list[str], env: dict[str, str] | None = None) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv[:6])}… exited with {done.returncode}: {done.stderr[-2000:]}")


@contextlib.contextmanager
def postgres_server(bin_dir: Path, db: str = "optuna", timeout: float = 60.0) -> Iterator[str]:
    """A throw-away PostgreSQL cluster on a free loopback port with password auth for one role; yields the
    SQLAlchemy URL (`postgresql+psycopg://…`) of database `db`. Its folder is a fresh one under the system
    temp dir (pytest's tmp_path is root's alone, and the cluster may run as another user), removed after."""
    user = pg_user()
    root = Path(tempfile.mkdtemp(prefix="lorafleet-pg-"))
    data, sock, pw_file, log = root / "data", root / "sock", root / "pw", root / "postgres.log"
    sock.mkdir()
    password = os.urandom(12).hex()
    pw_file.write_text(password)
    pw_file.chmod(0o600)
    log.touch()
    if user:
        for path in (root, sock, pw_file, log):
            shutil.chown(path, user)
    proc: subprocess.Popen[bytes] | None = None
    try:
        _run(_as(user, [str(bin_dir / "initdb"), "-D", str(data), "-U", "lorafleet", "--pwfile", str(pw_file),
                        "-A", "scram-sha-256", "--no-sync", "-E", "UTF8", "--locale", "C"]))
        port = free_port()
        with log.open("ab") as out:
            proc = subprocess.Popen(_as(user, [str(bin_dir / "postgres"), "-D", str(data), "-k", str(sock), "-p",
                                               str(port), "-h", "127.0.0.1", "-c", "fsync=off"]),
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def ready() -> bool:
            return subprocess.run([str(bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)],
                                  capture_output=True).returncode == 0

        _wait_ready(proc, log, ready, "postgres", timeout)
        _run([str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "lorafleet", db],
             env={**os.environ, "PGPASSWORD": password})
        yield f"postgresql+psycopg://lorafleet:{password}@127.0.0.1:{port}/{db}"
    finally:
        if proc is not None:
            # SIGINT is PostgreSQL's fast shutdown (SIGTERM waits for every client to leave).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=20)
            stop_group(proc.pid, 5.0, "postgres")
        shutil.rmtree(root, ignore_errors=True)
