"""The processes of a local cluster, found by what is running rather than by a file that may be stale.

A part of the cluster under LORAFLEET_HOME is recognised by its command line, which names that
home's files: nats-server runs `-c <home>/nats/nats-server.conf` (node i of a cluster, part
`nats-server-<i>`: `-c <home>/nats/n<i>/nats-server.conf`), workers and the gateway run
`-m lorafleet.sidecar|serve --fleet <home>/fleet.yaml`, the supervisor `-m lorafleet.cli up` with
`--home <home>`. So `lorafleet status` and `down` see a part that was restarted (by the supervisor,
or by hand with the same config) and never mistake another program for one, even after pid reuse.

Every part leads its own process group (`start_new_session`): stopping one stops exactly it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

NATS_CONFIG = Path("nats") / "nats-server.conf"
FLEET_FILE = "fleet.yaml"
SUPERVISOR = "supervisor"


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


def _signal(pid: int, sig: int) -> None:
    """`sig` to the process group `pid` leads, or to `pid` alone when it leads none (started by hand)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def stop_group(pid: int, timeout: float, name: str = "") -> None:
    """SIGTERM the process group led by `pid`, SIGKILL it after `timeout` seconds."""
    _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(pid):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    if pid_alive(pid):
        _signal(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _arg(cmdline: list[str], flag: str) -> str | None:
    for i, a in enumerate(cmdline[:-1]):
        if a == flag:
            return cmdline[i + 1]
    return None


def part_name(cmdline: list[str], home: Path) -> str | None:
    """Which part of the cluster under `home` this command line is, or None."""
    if not cmdline:
        return None
    if Path(cmdline[0]).name == "nats-server":
        config = Path(_arg(cmdline, "-c") or "")
        if config == home / NATS_CONFIG:
            return "nats-server"
        node = config.parent.name  # n<i> of a cluster (nats_cluster.py)
        if config.name == NATS_CONFIG.name and config.parent.parent == home / NATS_CONFIG.parent \
                and node[:1] == "n" and node[1:].isdigit():
            return f"nats-server-{node[1:]}"
        return None
    module = _arg(cmdline, "-m")
    if module == "lorafleet.cli" and "up" in cmdline:
        return SUPERVISOR if _arg(cmdline, "--home") == str(home) else None
    if _arg(cmdline, "--fleet") != str(home / FLEET_FILE):
        return None
    if module == "lorafleet.sidecar":
        return _arg(cmdline, "--worker-id") or "worker"
    if module == "lorafleet.serve":
        return "gateway"
    return None


def find_parts(home: Path) -> dict[str, int]:
    """name → pid of every running part of the cluster under `home` (zombies and this process excluded)."""
    import psutil

    home = home.resolve()
    found: dict[str, int] = {}
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        info = proc.info
        if info.get("status") == psutil.STATUS_ZOMBIE or info["pid"] == me:
            continue
        name = part_name(info.get("cmdline") or [], home)
        if name is not None and (name not in found or info["pid"] < found[name]):
            found[name] = info["pid"]
    return found


def stop_order(names: list[str]) -> list[str]:
    """Supervisor first (so it restarts nothing), then workers (they drain), the gateway, nats-server (or every
    node of a cluster) last."""
    rank = {SUPERVISOR: 0, "gateway": 2}
    return sorted(names, key=lambda n: (3 if n.startswith("nats-server") else rank.get(n, 1), n))
