"""The local cluster: embedded nats-server, N worker processes and one gateway on one machine, supervised.

Every part runs in its own process group under LORAFLEET_HOME, so `lorafleet down` (or the
test that started it) stops exactly what it started and nothing else. The CLI (`lorafleet up`),
tune (a private cluster per sweep), tests and benchmarks drive it through its public methods;
the parts are started as `python -m lorafleet.sidecar` / `python -m lorafleet.serve`, so this
core module imports no stage.

Security by default (docs/security.md): nats-server runs with authentication on; the role
credentials live in `<home>/creds` (0600) and each part gets only its own (gateway, worker);
the admin credential applies the layout (streams, buckets) at start, and a layout keeper in this
process (layout.py) creates again a stream or bucket that is lost: no other role may create streams. `tls=True` adds a
private CA and a TLS-only server. `auth=False` is the old open server (`--insecure-no-auth`).

With `supervise=True` a supervisor thread (supervisor.py) restarts a part that exits, with back-off.

`nats_nodes=3` starts a JetStream cluster instead of one nats-server (nats_cluster.py: parts
`nats-server-1..3`, routes on the cluster's host, the same credentials on every node); the parts get
every node's URL and fail over among them, and the streams and fleet bucket get R3 unless the fleet
file says otherwise (`nats.replicas`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import yaml

from lorafleet.core import plugins, settings
from lorafleet.core.config import FleetConfig, load_yaml_model
from lorafleet.core.heartbeats import ENV_RESTARTS
from lorafleet.models.device import nvidia_gpu_present
from lorafleet.nats.auth import TlsFiles
from lorafleet.nats.client import ClientSettings, join_urls
from lorafleet.nats.cluster import local_nats, plan_replicas, recorded_nodes
from lorafleet.nats.server import NatsServer, NatsServerError, free_port, port_open
from lorafleet.nats.tls import issue_certificate, make_self_signed_ca
from lorafleet.ops.cluster_state import STATE_FILE, ClusterError, ClusterState, collect_status, down
from lorafleet.ops.layout import LayoutKeeper, apply_layout
from lorafleet.ops.processes import find_parts, pid_alive, stop_group
from lorafleet.ops.supervisor import RestartPolicy, Supervisor
from lorafleet.ops.threads import auto_workers, available_cpus, plan_threads, pool_env

__all__ = ["ClusterError", "ClusterState", "LocalCluster", "apply_layout", "collect_status", "down", "load_fleet",
           "pid_alive", "stop_group"]

ROLE_OF_PART = {"gateway": "gateway"}  # every other part but the nats-server node(s) is a worker


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine to the end from sync code, even when the calling thread runs an event loop."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name="lorafleet-cluster-async")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def default_workers(fleet: FleetConfig, worker_threads: int | None = None) -> tuple[int, str]:
    """How many workers `lorafleet up` starts when not told, and why (lorafleet/ops/threads.py, auto_workers)."""
    single: str | None = None
    device = fleet.worker.device
    if device.startswith("cuda") or (device == "auto" and nvidia_gpu_present()):
        single = "1 worker: it owns the GPU"
    else:
        engines = [b.name for b in fleet.bases
                   if getattr(plugins.load(plugins.RUNTIMES, b.runtime), "one_worker_per_host", False)]
        if engines:
            single = f"1 worker: {', '.join(engines)} run(s) on an engine that uses this host's cores itself"
    return auto_workers(available_cpus(), single, worker_threads or fleet.worker.threads)


class LocalCluster:
    """Starts, supervises and stops the parts of a one-machine cluster; used by the CLI, tests and benchmarks."""

    def __init__(self, fleet: FleetConfig | None = None, *, workers: int = 1, port: int | None = None,
                 home: Path | None = None, nats_port: int | None = None, host: str = "127.0.0.1",
                 extra_env: dict[str, str] | None = None, auth: bool = True, tls: bool = False,
                 supervise: bool = False, on_event: Callable[[str], None] | None = None,
                 restart_policy: RestartPolicy | None = None, supervisor_pid: int | None = None,
                 worker_threads: int | None = None, nats_nodes: int = 1) -> None:
        if workers < 0:
            raise ClusterError("--workers must be 0 or more")
        if worker_threads is not None and worker_threads < 1:
            raise ClusterError(f"--worker-threads must be 1 or more, got {worker_threads}")
        if tls and not auth:
            raise ClusterError("TLS without authentication protects nothing worth it: drop --insecure-no-auth")
        self.fleet = (fleet or FleetConfig()).model_copy(deep=True)
        self.nats_nodes = nats_nodes
        try:  # R3 on a cluster unless the fleet file says otherwise; never more replicas than nodes
            self.fleet.nats.replicas = plan_replicas(self.fleet.nats.replicas, nats_nodes)
        except NatsServerError as exc:
            raise ClusterError(str(exc)) from exc
        self.workers = workers
        self.home = (home or settings.home()).resolve()
        self.host = host
        self.port = self.fleet.gateway.port if port is None else port
        if self.port == 0:
            self.port = free_port(host)
        self.nats_port = nats_port
        self.extra_env = extra_env or {}
        # Each worker's share of this host's CPUs (lorafleet/ops/threads.py); an explicit count or OMP_NUM_THREADS wins.
        self.threads = plan_threads(available_cpus(), workers, worker_threads or self.fleet.worker.threads,
                                    {**os.environ, **self.extra_env})
        self.auth, self.tls = auth, tls
        self.supervise, self.on_event = supervise, on_event
        self.restart_policy = restart_policy or RestartPolicy()
        # The CLI's `up` process, recorded so `lorafleet down` can stop it first (never a test runner's pid).
        self.supervisor_pid = supervisor_pid
        self.nats: NatsServer | None = None  # the single server, or node 1 of a cluster
        self.nats_servers: dict[str, NatsServer] = {}  # part name (nats-server, nats-server-1, …) → node
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.state: ClusterState | None = None
        self.supervisor: Supervisor | None = None
        self.keeper: LayoutKeeper | None = None  # heals the streams and buckets, with admin (layout.py)
        self._argv: dict[str, list[str]] = {}
        self._lock = threading.RLock()

    @property
    def _local_host(self) -> str:
        """Where this machine's own parts reach a server listening on `host` (loopback for a wildcard)."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def gateway_url(self) -> str:
        return f"http://{self._local_host}:{self.port}"

    @property
    def nats_url(self) -> str:
        """The server's URL, or every node's, comma-separated (what --nats-url and the fleet's nats_url take)."""
        assert self.nats_servers, "start the cluster first"
        local = f"//{self._local_host}:"
        return join_urls([s.url.replace(f"//{self.host}:", local) for s in self.nats_servers.values()])

    def _start_nats(self, tls: TlsFiles | None) -> None:
        nats_port = self.nats_port or (4222 if not port_open(self.host, 4222) else free_port(self.host))
        self.nats_servers = local_nats(self.home, self.nats_nodes, host=self.host, port=nats_port,
                                       creds=self.home / "creds" if self.auth else None, tls=tls)
        self.nats = next(iter(self.nats_servers.values()))

    def client(self, role: str | None = "admin") -> ClientSettings:
        """The credential of `role` (and the CA) for this cluster's NATS; none without auth."""
        assert self.state is not None, "start the cluster first"
        return self.state.client(role)

    def client_options(self, role: str | None = "admin") -> dict[str, Any]:
        """`nats.connect(cluster.nats_url, **cluster.client_options("worker"))`."""
        return self.client(role).options()

    # -- starting ---------------------------------------------------------------------------

    def _check_not_running(self) -> None:
        running = {n: p for n, p in find_parts(self.home).items()}
        if (self.home / STATE_FILE).exists():
            old = ClusterState.load(self.home)
            if old.supervisor_pid and old.supervisor_pid != os.getpid() and pid_alive(old.supervisor_pid):
                running.setdefault("supervisor", old.supervisor_pid)
        if running:
            raise ClusterError(f"a cluster is already running under {self.home} ({', '.join(sorted(running))}); "
                               "stop it with `lorafleet down`")
        (self.home / STATE_FILE).unlink(missing_ok=True)

    def _server_tls(self) -> TlsFiles:
        """A private CA and a server certificate for this host's names (remote workers need one of them)."""
        ca = make_self_signed_ca(self.home / "tls")
        names = ["localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()]
        if self.host not in ("0.0.0.0", "::", ""):
            names.append(self.host)
        return issue_certificate(ca, self.home / "tls", "nats-server", hosts=tuple(dict.fromkeys(names)))

    def start(self, timeout: float = 180.0, progress: bool = False) -> LocalCluster:
        self._check_not_running()
        if port_open(self.host, self.port):
            raise ClusterError(f"port {self.port} is already in use; choose another with --port")
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        try:
            what = "with authentication" + (" and TLS" if self.tls else "") if self.auth else "WITHOUT authentication"
            nodes = f"a {self.nats_nodes}-node cluster, R{self.fleet.nats.stream_replicas()}, " \
                if self.nats_nodes > 1 else ""
            self._say(progress, f"starting nats-server ({nodes}JetStream, {what})…")
            tls = self._server_tls() if self.tls else None
            self._start_nats(tls)
            self.fleet.nats_url = self.nats_url
            self.fleet.gateway.port = self.port
            fleet_file = self._write_fleet_file()
            tls_files = {k: str(v) for k, v in (("ca", tls.ca), ("cert", tls.cert), ("key", tls.key)) if v} if tls \
                else None
            self.state = ClusterState(
                home=str(self.home), nats_url=self.nats_url, gateway_url=self.gateway_url, fleet_file=str(fleet_file),
                pids={n: s.pid for n, s in self.nats_servers.items() if s.pid}, auth=self.auth, tls=tls_files,
                supervisor_pid=self.supervisor_pid, nats_host=self.host, nats_nodes=recorded_nodes(self.nats_servers))
            run_async(apply_layout(self.nats_url, self.client_options("admin"), self.fleet))
            self.keeper = LayoutKeeper(self.nats_url, self.client_options("admin"), self.fleet,
                                       on_event=self.on_event).start()
            for i in range(self.workers):
                self.start_worker(f"worker-{i + 1}")
            self._say(progress, f"starting {self.workers} worker(s) and the gateway…")
            self._spawn("gateway", [sys.executable, "-m", "lorafleet.serve", "--fleet", str(fleet_file),
                                    "--nats-url", self.nats_url, "--host", self.host, "--port", str(self.port)])
            self.wait_ready(timeout=timeout, workers=self.workers)
            with self._lock:
                self.state.ready = True
                self._save()
        except BaseException:
            self.stop()
            raise
        if self.supervise:
            self.supervisor = Supervisor(self, self.restart_policy, on_event=self.on_event).start()
        return self

    def start_worker(self, name: str) -> subprocess.Popen[bytes]:
        assert self.state is not None, "start the cluster first"
        return self._spawn(name, [sys.executable, "-m", "lorafleet.sidecar", "--fleet", self.state.fleet_file,
                                  "--nats-url", self.state.nats_url, "--worker-id", name,
                                  "--threads", str(self.threads.worker)])

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        assert self.state is not None
        log_path = self.home / "logs" / f"{name}.log"
        role = ROLE_OF_PART.get(name, "worker")
        pools = pool_env(self.threads.worker if role == "worker" else self.threads.gateway)
        env = {**os.environ, **pools, **self.extra_env, "LORAFLEET_HOME": str(self.home), "PYTHONUNBUFFERED": "1",
               **self.state.client(role).env(), ENV_RESTARTS: str(self.state.restarts.get(name, 0))}
        with self._lock, open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
            self.procs[name] = proc
            self._argv[name] = argv
            self.state.pids[name] = proc.pid
            self._save()
        return proc

    def _save(self) -> None:
        assert self.state is not None
        self.state.save(self.home / STATE_FILE)

    def _say(self, on: bool, text: str) -> None:
        if on:
            print(text, file=sys.stderr, flush=True)

    def _check_alive(self) -> None:
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None:
                tail = _tail(self.home / "logs" / f"{name}.log")
                raise ClusterError(f"{name} exited with code {proc.returncode} while starting; log tail:\n{tail}")

    def readyz(self) -> tuple[int, dict[str, Any]]:
        """The gateway's /readyz: (status code, body); (0, {}) when it does not answer."""
        try:
            r = httpx.get(f"{self.gateway_url}/readyz", timeout=2.0)
            return r.status_code, r.json()
        except (httpx.HTTPError, ValueError):
            return 0, {}

    def wait_ready(self, timeout: float = 180.0, workers: int | None = None) -> None:
        """Until the gateway answers /readyz and `workers` workers have sent a heartbeat for every base."""
        want = self.workers if workers is None else workers
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.supervisor is None:  # supervised parts that exit are restarted, not fatal
                self._check_alive()
            code, body = self.readyz()
            if (code == 200 or want == 0) and _workers_ready(body, self.fleet, want):
                return
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
        """The process id (= process group) of a running part: 'gateway', 'worker-1', 'nats-server'
        ('nats-server-1', … on a cluster), …"""
        if name in self.nats_servers:
            pid = self.nats_servers[name].pid
            assert pid is not None
            return pid
        return self.procs[name].pid

    def part_names(self) -> list[str]:
        return list(self.procs)

    def exited(self) -> list[tuple[str, int]]:
        """Parts that have exited since the last call, with their exit codes (forgotten once reported).

        Supervised parts are restarted instead, so this is empty while a supervisor runs.
        """
        if self.supervisor is not None:
            return []
        with self._lock:
            gone = [(name, proc.returncode) for name, proc in self.procs.items() if proc.poll() is not None]
            for name, _ in gone:
                self.procs.pop(name)
        return gone

    # -- supervision (supervisor.Supervised) ------------------------------------------------------

    def part_exit_codes(self) -> dict[str, int | None]:
        with self._lock:
            codes: dict[str, int | None] = {name: proc.poll() for name, proc in self.procs.items()}
            for name, server in self.nats_servers.items():
                if server.proc is not None:
                    codes[name] = server.proc.poll()
        return codes

    def respawn(self, name: str) -> None:
        """Start a part that exited again, the way it was started."""
        with self._lock:
            if name in self.nats_servers:
                server = self.nats_servers[name]
                assert self.state is not None
                if server.running():
                    return  # restarted by someone else meanwhile
                server.start()  # same ports and store: a cluster node rejoins and catches up
                assert server.proc is not None
                self.state.pids[name] = server.proc.pid
                self._save()
                return
            if name in self._argv and name in self.procs:
                self._spawn(name, self._argv[name])

    def record_restart(self, name: str, code: int) -> None:
        with self._lock:
            assert self.state is not None
            self.state.restarts[name] = self.state.restarts.get(name, 0) + 1
            self.state.last_exit[name] = code
            self._save()

    def restart_worker(self, name: str, fleet: FleetConfig | None = None, timeout: float = 30.0
                       ) -> subprocess.Popen[bytes]:
        """Stop worker `name` (draining), optionally rewrite the fleet file with `fleet`, start it again.

        NATS and the gateway stay up; only settings a worker reads at start (its profile) change.
        """
        assert self.state is not None, "start the cluster first"
        with self._lock:
            proc = self.procs.pop(name, None)
        if proc is not None:
            stop_group(proc.pid, timeout, name)
        if fleet is not None:
            self.fleet = fleet.model_copy(update={"nats_url": self.state.nats_url})
            self._write_fleet_file()
        return self.start_worker(name)

    def detach(self) -> None:
        """Forget the running parts: they run on in their own sessions after this process exits."""
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        self._stop_keeper()
        self.procs.clear()
        self.nats = None
        self.nats_servers = {}

    def _write_fleet_file(self) -> Path:
        path = self.home / "fleet.yaml"
        path.write_text(yaml.safe_dump(self.fleet.model_dump(mode="json"), sort_keys=False))
        return path

    # -- stopping ---------------------------------------------------------------------------

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to a part's process group (a test's crash); a supervisor restarts it."""
        pid = self.pid(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        if sig == signal.SIGKILL and name not in self.nats_servers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[name].wait(timeout=10)

    def kill_worker(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.kill(name, sig)

    def stop(self, timeout: float = 30.0) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        self._stop_keeper()
        with self._lock:
            procs = dict(self.procs)
            self.procs.clear()
        # Workers first (SIGTERM drains their in-flight tasks), then the gateway, then NATS.
        for name, proc in procs.items():
            if name.startswith("worker"):
                stop_group(proc.pid, timeout, name)
        if "gateway" in procs:
            stop_group(procs["gateway"].pid, 10.0, "gateway")
        for proc in procs.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=1)
        for server in self.nats_servers.values():
            server.stop()
        with contextlib.suppress(FileNotFoundError):
            (self.home / STATE_FILE).unlink()

    def _stop_keeper(self) -> None:
        if self.keeper is not None:
            self.keeper.stop()
            self.keeper = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _workers_ready(readyz: dict, fleet: FleetConfig, want: int) -> bool:
    if want == 0:  # a gateway alone (workers join from elsewhere) is up once it has its stream
        return bool(readyz.get("nats", {}).get("connected") and readyz.get("stream", {}).get("exists"))
    alive = readyz.get("workers", {})
    return all(int(alive.get(b.name, 0)) >= want for b in fleet.bases)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def load_fleet(path: str | Path | None) -> FleetConfig:
    from lorafleet.models.precision import check_fleet_precisions

    fleet = FleetConfig() if path is None else load_yaml_model(FleetConfig, path)
    check_fleet_precisions(fleet)  # an explicit precision the workers' device cannot run stops `up` here
    return fleet
