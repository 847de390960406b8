"""The local process supervisor: embedded nats-server, N worker processes and one gateway on one machine.

Every part runs in its own process group under LORAFLEET_HOME, so `lorafleet down` (or the
test that started it) stops exactly what it started and nothing else. The CLI (`lorafleet up`),
tune (a private cluster per sweep), tests and benchmarks drive it through its public methods;
the parts are started as `python -m lorafleet.sidecar` / `python -m lorafleet.serve`, so this
core module imports no stage.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

from lorafleet import heartbeats, settings
from lorafleet.config import FleetConfig, load_yaml_model
from lorafleet.nats_server import NatsServer, free_port, port_open
from lorafleet.queue import queue_depth

STATE_FILE = "cluster.json"


class ClusterError(RuntimeError):
    """The local cluster could not be started, found or stopped; the message says why."""


@dataclass
class ClusterState:
    """What `lorafleet up` leaves in LORAFLEET_HOME/cluster.json for `down` and `status`."""

    home: str
    nats_url: str
    gateway_url: str
    fleet_file: str
    pids: dict[str, int] = field(default_factory=dict)  # part name → pid (= its process group)
    started: float = field(default_factory=time.time)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, home: Path) -> ClusterState:
        path = home / STATE_FILE
        if not path.is_file():
            raise ClusterError(f"no local cluster is recorded under {home} (start one with `lorafleet up`)")
        return cls(**json.loads(path.read_text()))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); treat it as gone.
    with contextlib.suppress(Exception), open(f"/proc/{pid}/stat") as fh:
        if fh.read().split(")")[-1].split()[0] == "Z":
            return False
    return True


def stop_group(pid: int, timeout: float, name: str = "") -> None:
    """SIGTERM the process group led by `pid`, SIGKILL it after `timeout` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(pid):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


class LocalCluster:
    """Starts and stops the parts of a one-machine cluster; usable from the CLI, tests and benchmarks."""

    def __init__(self, fleet: FleetConfig | None = None, *, workers: int = 1, port: int | None = None,
                 home: Path | None = None, nats_port: int | None = None, host: str = "127.0.0.1",
                 extra_env: dict[str, str] | None = None) -> None:
        if workers < 0:
            raise ClusterError("--workers must be 0 or more")
        self.fleet = (fleet or FleetConfig()).model_copy(deep=True)
        self.workers = workers
        self.home = (home or settings.home()).resolve()
        self.host = host
        self.port = self.fleet.gateway.port if port is None else port
        if self.port == 0:
            self.port = free_port(host)
        self.nats_port = nats_port
        self.extra_env = extra_env or {}
        self.nats: NatsServer | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.state: ClusterState | None = None

    @property
    def gateway_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def nats_url(self) -> str:
        assert self.nats is not None
        return self.nats.url

    # -- starting ---------------------------------------------------------------------------

    def start(self, timeout: float = 180.0, progress: bool = False) -> LocalCluster:
        state_path = self.home / STATE_FILE
        if state_path.exists():
            old = ClusterState.load(self.home)
            if any(pid_alive(p) for p in old.pids.values()):
                raise ClusterError(
                    f"a cluster is already running under {self.home} (gateway {old.gateway_url}); "
                    "stop it with `lorafleet down`"
                )
            state_path.unlink()
        if port_open(self.host, self.port):
            raise ClusterError(f"port {self.port} is already in use; choose another with --port")
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        try:
            self._say(progress, "starting nats-server (JetStream)…")
            nats_port = self.nats_port or (4222 if not port_open(self.host, 4222) else free_port(self.host))
            self.nats = NatsServer(self.home / "nats", port=nats_port, host=self.host,
                                   log_file=logs / "nats-server.log").start()
            self.fleet.nats_url = self.nats.url
            self.fleet.gateway.port = self.port
            fleet_file = self._write_fleet_file()
            self.state = ClusterState(home=str(self.home), nats_url=self.nats.url, gateway_url=self.gateway_url,
                                      fleet_file=str(fleet_file), pids={"nats-server": self.nats.proc.pid})
            for i in range(self.workers):
                self.start_worker(f"worker-{i + 1}")
            self._say(progress, f"starting {self.workers} worker(s) and the gateway…")
            self._spawn("gateway", [sys.executable, "-m", "lorafleet.serve", "--fleet", str(fleet_file),
                                    "--nats-url", self.nats.url, "--host", self.host, "--port", str(self.port)])
            self.wait_ready(timeout=timeout, workers=self.workers)
        except BaseException:
            self.stop()
            raise
        return self

    def start_worker(self, name: str) -> subprocess.Popen[bytes]:
        assert self.state is not None, "start the cluster first"
        return self._spawn(name, [sys.executable, "-m", "lorafleet.sidecar", "--fleet", self.state.fleet_file,
                                  "--nats-url", self.state.nats_url, "--worker-id", name])

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        assert self.state is not None
        log_path = self.home / "logs" / f"{name}.log"
        env = {**os.environ, **self.extra_env, "LORAFLEET_HOME": str(self.home), "PYTHONUNBUFFERED": "1"}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        self.procs[name] = proc
        self.state.pids[name] = proc.pid
        self.state.save(self.home / STATE_FILE)
        return proc

    def _say(self, on: bool, text: str) -> None:
        if on:
            print(text, file=sys.stderr, flush=True)

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = _tail(self.home / "logs" / f"{name}.log")
                raise ClusterError(f"{name} exited with code {proc.returncode} while starting; log tail:\n{tail}")

    def wait_ready(self, timeout: float = 180.0, workers: int | None = None) -> None:
        """Until the gateway answers /readyz and `workers` workers have sent a heartbeat for every base."""
        want = self.workers if workers is None else workers
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                r = httpx.get(f"{self.gateway_url}/readyz", timeout=2.0)
                if r.status_code == 200 and _workers_ready(r.json(), self.fleet, want):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise ClusterError(f"the cluster was not ready within {timeout:.0f}s; logs are in {self.home / 'logs'}")

    @property
    def fleet_file(self) -> Path:
        """The fleet YAML every part of this cluster reads."""
        assert self.state is not None, "start the cluster first"
        return Path(self.state.fleet_file)

    def log_path(self, name: str) -> Path:
        return self.home / "logs" / f"{name}.log"

    def pid(self, name: str) -> int:
        """The process id (= process group) of a running part: 'gateway', 'worker-1', …"""
        return self.procs[name].pid

    def part_names(self) -> list[str]:
        return list(self.procs)

    def exited(self) -> list[tuple[str, int]]:
        """Parts that have exited since the last call, with their exit codes (forgotten once reported)."""
        gone = [(name, proc.returncode) for name, proc in self.procs.items() if proc.poll() is not None]
        for name, _ in gone:
            self.procs.pop(name)
        return gone

    def restart_worker(self, name: str, fleet: FleetConfig | None = None, timeout: float = 30.0
                       ) -> subprocess.Popen[bytes]:
        """Stop worker `name` (draining), optionally rewrite the fleet file with `fleet`, start it again.

        NATS and the gateway stay up; only settings a worker reads at start (its profile) change.
        """
        assert self.state is not None, "start the cluster first"
        proc = self.procs.pop(name, None)
        if proc is not None:
            stop_group(proc.pid, timeout, name)
        if fleet is not None:
            self.fleet = fleet.model_copy(update={"nats_url": self.state.nats_url})
            self._write_fleet_file()
        return self.start_worker(name)

    def detach(self) -> None:
        """Forget the running parts: they run on in their own sessions after this process exits."""
        self.procs.clear()
        self.nats = None

    def _write_fleet_file(self) -> Path:
        path = self.home / "fleet.yaml"
        path.write_text(yaml.safe_dump(self.fleet.model_dump(mode="json"), sort_keys=False))
        return path

    # -- stopping ---------------------------------------------------------------------------

    def kill_worker(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        if sig == signal.SIGKILL:
            proc.wait(timeout=10)

    def stop(self, timeout: float = 30.0) -> None:
        # Workers first (SIGTERM drains their in-flight tasks), then the gateway, then NATS.
        for name, proc in list(self.procs.items()):
            if name.startswith("worker"):
                stop_group(proc.pid, timeout, name)
        if "gateway" in self.procs:
            stop_group(self.procs["gateway"].pid, 10.0, "gateway")
        for proc in self.procs.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=1)
        self.procs.clear()
        if self.nats is not None:
            self.nats.stop()
        with contextlib.suppress(FileNotFoundError):
            (self.home / STATE_FILE).unlink()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _workers_ready(readyz: dict, fleet: FleetConfig, want: int) -> bool:
    if want == 0:
        return True
    alive = readyz.get("workers", {})
    return all(int(alive.get(b.name, 0)) >= want for b in fleet.bases)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def down(home: Path | None = None, timeout: float = 30.0) -> list[str]:
    """Stop the cluster recorded under `home` (workers, gateway, then nats-server); names stopped."""
    home = (home or settings.home()).resolve()
    state = ClusterState.load(home)
    stopped = []
    order = sorted(state.pids, key=lambda n: (n == "nats-server", n == "gateway"))
    for name in order:
        pid = state.pids[name]
        if pid_alive(pid):
            stop_group(pid, timeout if name.startswith("worker") else 10.0, name)
            stopped.append(name)
    (home / STATE_FILE).unlink(missing_ok=True)
    return stopped


async def collect_status(state: ClusterState, fleet: FleetConfig, listen_s: float = 1.5) -> dict:
    """Workers (from their heartbeats), queue depth and consumer lag, read live from NATS."""
    import nats

    nc = await nats.connect(state.nats_url, connect_timeout=2, max_reconnect_attempts=0)
    try:
        workers = await heartbeats.collect(nc, listen_s)
        try:
            depth = await queue_depth(nc.jetstream(), fleet.queue)
        except Exception as exc:  # the stream may not exist yet
            depth = {"error": str(exc)}  # type: ignore[dict-item]
    finally:
        await nc.drain()
    return {"workers": {k: asdict(v) for k, v in sorted(workers.items())}, "queue": depth}


def load_fleet(path: str | Path | None) -> FleetConfig:
    if path is None:
        return FleetConfig()
    return load_yaml_model(FleetConfig, path)
