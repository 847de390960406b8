"""What a local cluster leaves under LORAFLEET_HOME (`cluster.json`), and `down` / `status` built on it.

The state file says how to reach the cluster (URLs, whether NATS wants credentials and TLS) and
what the supervisor did (restarts, last exit codes). Which processes run is never taken from it:
`processes.find_parts` looks at what is running, so a part restarted by the supervisor or by hand
is seen, and a stale pid is never signalled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from lorafleet.core import heartbeats, settings
from lorafleet.core.config import FleetConfig
from lorafleet.nats.auth import CREDS_SUFFIX, TlsFiles, explain_connect_error
from lorafleet.nats.client import ClientSettings, quiet_tls_noise, server_urls
from lorafleet.nats.cluster import route_secret
from lorafleet.nats.queue import queue_depth
from lorafleet.nats.server import ClusterRoutes, NatsServer
from lorafleet.ops.processes import SUPERVISOR, find_parts, pid_alive, stop_group, stop_order

STATE_FILE = "cluster.json"
CONNECT_TIMEOUT_S = 5.0  # `lorafleet status`: how long NATS may take to answer before the local view is shown


class ClusterError(RuntimeError):
    """The local cluster could not be started, found or stopped; the message says why."""


@dataclass
class ClusterState:
    """What `lorafleet up` leaves in LORAFLEET_HOME/cluster.json for `down`, `status` and `creds`."""

    home: str
    nats_url: str
    gateway_url: str
    fleet_file: str
    pids: dict[str, int] = field(default_factory=dict)  # part name → pid when last started (informational)
    started: float = field(default_factory=time.time)
    auth: bool = False
    tls: dict[str, str] | None = None  # the server's TLS files: ca, cert, key
    restarts: dict[str, int] = field(default_factory=dict)
    last_exit: dict[str, int] = field(default_factory=dict)
    supervisor_pid: int | None = None
    ready: bool = False
    nats_host: str = "127.0.0.1"  # where the nodes listen (the URLs say where this machine reaches them)
    # Part name → {"port", "routes"} for each node, so `creds add|revoke` can re-render and reload every node's
    # config as it was started. The route password is not here: it stays in its 0600 file (nats_cluster.py).
    nats_nodes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, home: Path) -> ClusterState:
        path = home / STATE_FILE
        if not path.is_file():
            raise ClusterError(f"no local cluster is recorded under {home} (start one with `lorafleet up`)")
        raw = json.loads(path.read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def creds_path(self, role: str) -> Path | None:
        return Path(self.home) / "creds" / f"{role}{CREDS_SUFFIX}" if self.auth else None

    def client(self, role: str | None) -> ClientSettings:
        """The credential of `role` and the server's CA: how a part or the CLI connects to this cluster."""
        ca = Path(self.tls["ca"]) if self.tls and self.tls.get("ca") else None
        return ClientSettings(self.creds_path(role) if role else None, TlsFiles(ca=ca) if ca else None)

    def nats_servers(self) -> dict[str, NatsServer]:
        """Part name → this cluster's nats-server node(s), configured as started (not started: to reload the
        running ones after `adopt`)."""
        tls = None
        if self.tls:
            tls = TlsFiles(*(Path(self.tls[k]) if self.tls.get(k) else None for k in ("ca", "cert", "key")))
        home = Path(self.home)
        creds = home / "creds" if self.auth else None
        if not self.nats_nodes:  # one server (or a state written before nodes were recorded)
            url = urlsplit(server_urls(self.nats_url)[0])
            return {"nats-server": NatsServer(home / "nats", port=url.port, host=self.nats_host,
                                              log_file=home / "logs" / "nats-server.log", creds=creds, tls=tls)}
        password = route_secret(home / "nats")
        return {name: NatsServer(home / "nats" / node["dir"], port=node["port"], host=self.nats_host,
                                 log_file=home / "logs" / f"{name}.log", creds=creds, tls=tls,
                                 routes=ClusterRoutes(**{**node["routes"], "peers": tuple(node["routes"]["peers"]),
                                                         "password": password}))
                for name, node in self.nats_nodes.items()}


def supervisor_alive(state: ClusterState | None) -> int | None:
    """The supervisor's pid when it still runs (checked against its command line, not only the pid)."""
    if state is None or not state.supervisor_pid or not pid_alive(state.supervisor_pid):
        return None
    try:
        import psutil

        cmdline = psutil.Process(state.supervisor_pid).cmdline()
    except Exception:
        return None
    return state.supervisor_pid if "up" in cmdline and any("lorafleet" in a for a in cmdline) else None


def running_parts(home: Path, state: ClusterState | None) -> dict[str, int]:
    parts = find_parts(home)
    sup = supervisor_alive(state)
    if sup is not None:
        parts[SUPERVISOR] = sup
    return parts


def down(home: Path | None = None, timeout: float = 30.0) -> list[str]:
    """Stop the cluster under `home`: its supervisor first (it stops the parts in order), then whatever of it
    still runs — found by command line, so a restarted or replaced part is stopped too. Names stopped."""
    home = (home or settings.home()).resolve()
    state = ClusterState.load(home) if (home / STATE_FILE).is_file() else None
    parts = running_parts(home, state)
    if state is None and not parts:
        raise ClusterError(f"no local cluster is recorded or running under {home} (start one with `lorafleet up`)")
    stopped = []
    sup = parts.pop(SUPERVISOR, None)
    before = dict(parts)
    if sup is not None:
        os.kill(sup, signal.SIGTERM)  # a supervisor stops its parts itself, workers first
        deadline = time.monotonic() + timeout + 20.0
        while time.monotonic() < deadline and pid_alive(sup):
            time.sleep(0.1)
        if pid_alive(sup):
            stop_group(sup, 1.0, SUPERVISOR)
        stopped.append(SUPERVISOR)
        parts = find_parts(home)
        stopped += stop_order([n for n in before if n not in parts])  # what the supervisor stopped itself
    for name in stop_order(list(parts)):
        pid = parts[name]
        if pid_alive(pid):
            stop_group(pid, timeout if name.startswith("worker") else 10.0, name)
            stopped.append(name)
    (home / STATE_FILE).unlink(missing_ok=True)
    return stopped


async def collect_status(state: ClusterState | None, fleet: FleetConfig, listen_s: float = 1.5,
                         client: ClientSettings | None = None, nats_url: str | None = None) -> dict[str, Any]:
    """The cluster as NATS sees it, from any host: every process's presence (role, host, pid, state,
    restarts), workers' heartbeats, queue depth and consumer lag. `nats_url` and `client` default to the
    local cluster's (`state`, control credential); ClusterError when NATS cannot be reached."""
    import nats

    quiet_tls_noise()
    url = nats_url or (state.nats_url if state is not None else None)
    if not url:
        raise ClusterError("no NATS URL: pass --nats-url (and --creds), or start a local cluster with `lorafleet up`")
    if client is None:
        client = ClientSettings.resolve(fallback_creds=state.creds_path("control") if state is not None else None)
    if client.tls is None and state is not None and state.tls:
        client = dataclasses.replace(client, tls=state.client(None).tls)
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:  # nats-py would log a traceback per attempt
        errors.append(exc)

    try:  # bounded: a refused first connect makes nats-py try again for ever, whatever its options say
        nc = await asyncio.wait_for(nats.connect(server_urls(url), connect_timeout=2, max_reconnect_attempts=0,
                                                 allow_reconnect=False, error_cb=on_error, **client.options()),
                                    CONNECT_TIMEOUT_S)
    except Exception as exc:
        cause = errors[-1] if isinstance(exc, TimeoutError) and errors else exc
        if isinstance(cause, TimeoutError):
            raise ClusterError(f"no answer from NATS at {url} within {CONNECT_TIMEOUT_S:.0f}s") from exc
        raise ClusterError(explain_connect_error(cause, url)) from exc
    try:
        workers, present = await asyncio.gather(heartbeats.collect(nc, listen_s),
                                                heartbeats.collect_presence(nc, listen_s))
        try:
            depth = await queue_depth(nc.jetstream(), fleet.queue)
        except Exception as exc:  # the stream may not exist yet
            depth = {"error": str(exc)}  # type: ignore[dict-item]
    finally:
        await nc.drain()
    now = time.time()
    cluster = {key: {**asdict(p), "up_s": round(now - p.started, 1) if p.started else None}
               for key, p in sorted(present.items())}
    return {"source": "nats", "nats_url": url, "cluster": cluster,
            "workers": {k: asdict(v) for k, v in sorted(workers.items())}, "queue": depth}


def processes(home: Path, state: ClusterState) -> dict[str, dict[str, Any]]:
    """Each part: pid when running (found by command line), restarts and last exit code (from the supervisor)."""
    running = running_parts(home, state)
    names = list(dict.fromkeys([*stop_order(list(running)), *state.pids]))
    return {name: {"pid": running.get(name), "alive": name in running, "restarts": state.restarts.get(name, 0),
                   "last_exit": state.last_exit.get(name)} for name in names}
