"""`lorafleet status` reads the cluster from NATS: from another host (only a URL and a credential), from the
host that runs it, and falls back to the local processes, saying so, when NATS cannot be reached."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from queue_plane_kit import synth_fleet, until

from lorafleet.nats.server import free_port
from lorafleet.ops.cluster import ClusterState, LocalCluster

pytestmark = pytest.mark.integration


def status(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAFLEET_NATS_")}
    return subprocess.run([sys.executable, "-m", "lorafleet.cli", "status", *args], capture_output=True, text=True,
                          timeout=60, check=check, env={**env, "LORAFLEET_HOME": str(home)})


def members(info: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{p['role']}/{p['name']}": p for p in info["cluster"].values()}


def test_status_without_a_cluster_or_url_says_what_to_pass(tmp_path: Path) -> None:
    out = status(tmp_path / "empty", check=False)
    assert out.returncode == 1 and "--nats-url" in out.stderr, out.stderr
    dead = f"nats://127.0.0.1:{free_port()}"
    out = status(tmp_path / "empty", "--nats-url", dead, "--json", check=False)
    assert out.returncode == 1 and "cannot read the cluster from NATS" in out.stderr, out.stderr


def test_status_from_nats_shows_every_process_with_host_pid_state_and_restarts(tmp_path: Path) -> None:
    home = tmp_path / "home"
    c = LocalCluster(synth_fleet(), workers=1, port=0, home=home, supervise=True).start()
    try:
        c.kill("worker-1")  # the supervisor restarts it, telling it its restart count
        until(lambda: ClusterState.load(home).restarts == {"worker-1": 1}, 20, "worker-1 restarted")
        want_worker = {"role": "worker", "host": socket.gethostname(), "state": "serving", "restarts": 1}

        # Another host: no LORAFLEET_HOME of its own, only the URL and the control credential.
        def remote_status() -> dict[str, Any]:
            return json.loads(status(tmp_path / "elsewhere", "--json", "--nats-url", c.nats_url,
                                     "--creds", str(home / "creds" / "control.nk")).stdout)

        # The gateway's readiness still counts the killed worker's last heartbeat for a few seconds, so wait for
        # the restarted process itself (its pid) to announce that it serves.
        def restarted_serves() -> bool:
            w = members(remote_status()).get("worker/worker-1")
            return w is not None and w["pid"] == c.pid("worker-1") and w["state"] == "serving"

        until(restarted_serves, 60, "the restarted worker-1 serving")
        remote = remote_status()
        assert remote["source"] == "nats" and "processes" not in remote
        seen = members(remote)
        worker = seen.get("worker/worker-1")
        assert worker is not None, remote
        assert {k: worker[k] for k in want_worker} == want_worker and worker["pid"] == c.pid("worker-1")
        gateways = [p for p in seen.values() if p["role"] == "gateway"]
        assert len(gateways) == 1, remote
        assert gateways[0]["pid"] == c.pid("gateway") and gateways[0]["state"] == "ready"
        assert gateways[0]["restarts"] == 0 and gateways[0]["host"] == socket.gethostname()
        assert remote["workers"]["worker-1"]["bases"] == ["m"] and "workers-m" in remote["queue"]
        # Without the credential, NATS refuses: an error that says so, not a traceback.
        refused = status(tmp_path / "elsewhere", "--json", "--nats-url", c.nats_url, check=False)
        assert refused.returncode == 1 and "cannot read the cluster from NATS" in refused.stderr, refused.stderr

        # This host: URL and credential from LORAFLEET_HOME; the local processes as well.
        local = json.loads(status(home, "--json").stdout)
        assert members(local)["worker/worker-1"]["restarts"] == 1
        assert local["processes"]["worker-1"]["restarts"] == 1 and local["processes"]["nats-server"]["alive"]
        text = status(home).stdout
        assert "cluster (from NATS" in text and "worker-1" in text and "restarts 1" in text, text

        # NATS unreachable: the local view, and the output says so.
        dead = f"nats://127.0.0.1:{free_port()}"
        fallback = status(home, "--json", "--nats-url", dead)
        info = json.loads(fallback.stdout)
        assert info["source"] == "local" and "NATS unreachable" in info["note"] and info["cluster"] == {}
        assert info["processes"]["worker-1"]["alive"]
        assert "NATS unreachable" in status(home, "--nats-url", dead).stderr
    finally:
        c.stop()
