"""A JetStream cluster of N nats-server nodes on one host: `lorafleet up --nats-nodes 3`, tests and benchmarks.

Each node is a `NatsServer` with its own client port, route port, store (`<root>/n<i>`), config and log,
the same authorization (one creds folder: every node admits the same credentials, each within its role)
and the same TLS files for clients. Clients reach the nodes on `host`; routes (node to node) listen on
loopback only, whatever `host` is — every node runs on this host — and admit only nodes that present the
cluster's route password (`<root>/route.secret`, 0600, made once and kept, so a node restarted later
rejoins). Streams and the fleet bucket get their replicas from `FleetConfig.nats.replicas`;
with R3 a cluster of three keeps serving while any one node is down.

Node `i` (1-based) is the part `nats-server-<i>`; its command line names `<root>/n<i>/nats-server.conf`,
which is how `processes.find_parts` recognises it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import time
from pathlib import Path
from typing import Any

from lorafleet.nats.auth import CredentialSet, TlsFiles
from lorafleet.nats.client import join_urls
from lorafleet.nats.permissions import Layout
from lorafleet.nats.server import ClusterRoutes, NatsServer, NatsServerError, free_port

CLUSTER_NAME = "lorafleet"
ROUTE_USER = "route"
ROUTE_HOST = "127.0.0.1"  # every node runs on this host: routes never need to leave it
SECRET_FILE = "route.secret"
# What a node logs once the cluster has elected the leader of its JetStream metadata: streams can be made.
_META_LEADER = ("JetStream cluster new metadata leader", "Self is new JetStream cluster metadata leader")


def node_name(index: int) -> str:
    """The part name of node `index` (1-based): `nats-server-1`, …"""
    return f"nats-server-{index}"


def node_dir(root: Path, index: int) -> Path:
    return root / f"n{index}"


def route_secret(root: Path) -> str:
    """The cluster's route password: made once under `root` (0600) and reused by every later start."""
    path = root / SECRET_FILE
    if path.is_file():
        return path.read_text().strip()
    root.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


class NatsCluster:
    """`nodes` nats-server processes forming one JetStream cluster; each runs in its own process group.

    `ports`: the nodes' client ports (default: free ones). `log_dir`: where `nats-server-<i>.log` go
    (default: each node's folder). `servers` maps part name → NatsServer, for the supervisor and tests.
    """

    def __init__(self, root: str | Path, nodes: int = 3, *, host: str = "127.0.0.1", ports: list[int] | None = None,
                 log_dir: str | Path | None = None, creds: str | Path | CredentialSet | None = None,
                 tls: TlsFiles | None = None, verify_clients: bool = False, layout: Layout = Layout(),
                 name: str = CLUSTER_NAME) -> None:
        if nodes < 1:
            raise NatsServerError(f"a NATS cluster needs at least one node, got {nodes}")
        if ports is not None and len(ports) != nodes:
            raise NatsServerError(f"{nodes} nodes need {nodes} client ports, got {len(ports)}")
        self.root = Path(root)
        self.host = host
        client_ports = list(ports) if ports is not None else [free_port(host) for _ in range(nodes)]
        route_ports = [free_port(ROUTE_HOST) for _ in range(nodes)]
        secret = route_secret(self.root)
        self.servers: dict[str, NatsServer] = {}
        for i in range(1, nodes + 1):
            peers = tuple(f"{ROUTE_HOST}:{p}" for j, p in enumerate(route_ports, 1) if j != i)
            routes = ClusterRoutes(cluster=name, server_name=f"n{i}", host=ROUTE_HOST, port=route_ports[i - 1],
                                   peers=peers, user=ROUTE_USER, password=secret)
            log_file = Path(log_dir) / f"{node_name(i)}.log" if log_dir is not None else None
            self.servers[node_name(i)] = NatsServer(node_dir(self.root, i), port=client_ports[i - 1], host=host,
                                                    log_file=log_file, creds=creds, tls=tls,
                                                    verify_clients=verify_clients, layout=layout, routes=routes)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers.values()]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated: what `--nats-url` and the fleet's `nats_url` take."""
        return join_urls(self.urls)

    def node(self, name: str) -> NatsServer:
        return self.servers[name]

    def start(self, timeout: float = 30.0) -> NatsCluster:
        """Start every node, then wait until the cluster has a JetStream metadata leader (streams can be made)."""
        offsets = {n: _size(s.log_file) for n, s in self.servers.items()}
        try:
            for server in self.servers.values():
                server.start(timeout=timeout)
            self.wait_meta_leader(offsets, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_meta_leader(self, offsets: dict[str, int] | None = None, timeout: float = 30.0) -> None:
        """Until a node logs (after `offsets`, its log sizes before the start) that a metadata leader exists."""
        offsets = offsets or {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, server in self.servers.items():
                if _logged_any(server.log_file, offsets.get(name, 0), _META_LEADER):
                    return
            for name, server in self.servers.items():
                if server.proc is not None and server.proc.poll() is not None:
                    raise NatsServerError(f"{name} exited with {server.proc.returncode}; see {server.log_file}")
            time.sleep(0.05)
        logs = ", ".join(str(s.log_file) for s in self.servers.values())
        raise NatsServerError(f"the NATS cluster elected no JetStream leader within {timeout:.0f}s; see {logs}")

    def running(self) -> bool:
        return all(s.running() for s in self.servers.values())

    def stop(self, timeout: float = 10.0) -> None:
        for server in self.servers.values():
            with contextlib.suppress(Exception):
                server.stop(timeout)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def plan_replicas(wanted: int | None, nodes: int) -> int | None:
    """The replicas a local cluster of `nodes` uses: `wanted` (the fleet file's nats.replicas), else R3 on a
    cluster (R = nodes below 3), else None (one). NatsServerError when they cannot work."""
    if nodes < 1:
        raise NatsServerError(f"--nats-nodes must be 1 or more, got {nodes}")
    if nodes == 2:
        raise NatsServerError("--nats-nodes 2 makes a cluster that stops when either node does (JetStream needs a "
                              "majority of its nodes): use 3")
    if wanted is not None and wanted > nodes:
        raise NatsServerError(f"the fleet file asks for nats.replicas={wanted} but the cluster has {nodes} NATS "
                              f"node(s): start more with --nats-nodes {wanted}, or lower nats.replicas")
    if wanted is None and nodes > 1:
        return min(3, nodes)
    return wanted


def local_nats(home: Path, nodes: int, *, host: str, port: int, creds: Path | None,
               tls: TlsFiles | None) -> dict[str, NatsServer]:
    """Started: one nats-server (part `nats-server`, store `<home>/nats`) or a cluster of `nodes` (parts
    `nats-server-<i>`, stores `<home>/nats/n<i>`; node 1 on `port`); logs in `<home>/logs`. Part name → node."""
    if nodes == 1:
        server = NatsServer(home / "nats", port=port, host=host, log_file=home / "logs" / "nats-server.log",
                            creds=creds, tls=tls)
        return {"nats-server": server.start()}
    ports = [port] + [free_port(host) for _ in range(nodes - 1)]
    cluster = NatsCluster(home / "nats", nodes, host=host, ports=ports, log_dir=home / "logs", creds=creds, tls=tls)
    return dict(cluster.start().servers)


def recorded_nodes(servers: dict[str, NatsServer]) -> dict[str, dict[str, Any]]:
    """What cluster.json keeps of a cluster's nodes to render their configs again (`creds add` reloads them):
    folder, client port and routes, without the route password (it stays in its 0600 file)."""
    out: dict[str, dict[str, Any]] = {}
    for name, server in servers.items():
        if server.routes is None:
            continue
        routes = {k: v for k, v in dataclasses.asdict(server.routes).items() if k != "password"}
        out[name] = {"dir": server.store_dir.name, "port": server.port, "routes": routes}
    return out


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _logged_any(path: Path, offset: int, texts: tuple[str, ...]) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            new = f.read().decode(errors="replace")
    except OSError:
        return False
    return any(t in new for t in texts)
