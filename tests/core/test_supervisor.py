"""The supervisor's restart rule, and finding a cluster's processes by their command lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorafleet.ops.processes import find_parts, part_name, stop_group, stop_order
from lorafleet.ops.supervisor import RestartPolicy, Supervisor
from lorafleet.testing import wait_until


class FakeCluster:
    def __init__(self) -> None:
        self.codes: dict[str, int | None] = {"worker-1": None, "gateway": None}
        self.respawned: list[str] = []
        self.restarts: dict[str, int] = {}

    def part_exit_codes(self) -> dict[str, int | None]:
        return dict(self.codes)

    def respawn(self, name: str) -> None:
        self.respawned.append(name)
        self.codes[name] = None

    def record_restart(self, name: str, code: int) -> None:
        self.restarts[name] = self.restarts.get(name, 0) + 1


def test_backoff_doubles_for_quick_failures_and_resets_after_a_stable_run() -> None:
    policy = RestartPolicy(first_s=0.5, factor=2.0, max_s=4.0, stable_s=30.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 5, 9)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    now = [0.0]
    cluster = FakeCluster()
    sup = Supervisor(cluster, policy, on_event=lambda text: None, clock=lambda: now[0])
    sup.step()  # sees both running
    delays = []
    for _ in range(4):  # a crash loop: each run lasts 0.1 s
        now[0] += 0.1
        cluster.codes["worker-1"] = 1
        sup.step()
        t_exit = now[0]
        while "worker-1" not in cluster.respawned[len(delays):]:
            now[0] += 0.05
            sup.step()
        delays.append(round(now[0] - t_exit, 2))
    assert delays == pytest.approx([0.5, 1.0, 2.0, 4.0], abs=0.06)
    now[0] += 60.0  # a long healthy run, then one crash: restarted at the shortest delay again
    cluster.codes["worker-1"] = -9
    sup.step()
    now[0] += 0.5
    sup.step()
    assert cluster.respawned[-1] == "worker-1" and cluster.restarts == {"worker-1": 5}
    assert "gateway" not in cluster.respawned


def test_a_part_restarted_by_hand_is_left_alone() -> None:
    now = [0.0]
    cluster = FakeCluster()
    sup = Supervisor(cluster, RestartPolicy(first_s=1.0), on_event=lambda text: None, clock=lambda: now[0])
    sup.step()
    cluster.codes["gateway"] = 0
    sup.step()
    cluster.codes["gateway"] = None  # someone started it again meanwhile
    now[0] += 2.0
    sup.step()
    assert cluster.respawned == []


def test_parts_are_recognised_by_their_command_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    fleet = str(home / "fleet.yaml")
    assert part_name(["/venv/bin/nats-server", "-c", str(home / "nats" / "nats-server.conf")], home) == "nats-server"
    assert part_name(["/usr/bin/nats-server", "-c", "/elsewhere/nats-server.conf"], home) is None
    assert part_name(["python", "-m", "lorafleet.sidecar", "--fleet", fleet, "--worker-id", "worker-2"],
                     home) == "worker-2"
    assert part_name(["python", "-m", "lorafleet.serve", "--fleet", fleet, "--port", "8080"], home) == "gateway"
    assert part_name(["python", "-m", "lorafleet.serve", "--fleet", "/other/fleet.yaml"], home) is None
    assert part_name(["python", "-m", "lorafleet.cli", "up", "--home", str(home)], home) == "supervisor"
    assert part_name(["vim", fleet], home) is None and part_name([], home) is None
    assert stop_order(["nats-server", "gateway", "worker-2", "supervisor", "worker-1"]) == [
        "supervisor", "worker-1", "worker-2", "gateway", "nats-server"]


@pytest.mark.integration
def test_find_parts_sees_a_running_process_and_stop_group_stops_it(tmp_path: Path) -> None:
    home = (tmp_path / "home").resolve()
    code = "import time\nwhile True: time.sleep(1)\n"
    # Looks like a worker of `home` to find_parts (the command line is what counts), without loading anything.
    proc = subprocess.Popen([sys.executable, "-c", code, "-m", "lorafleet.sidecar", "--fleet",
                             str(home / "fleet.yaml"), "--worker-id", "worker-7"], start_new_session=True)
    try:
        wait_until(lambda: find_parts(home).get("worker-7") == proc.pid, 10, "find_parts seeing worker-7")
        assert os.getpid() not in find_parts(home).values()
    finally:
        stop_group(proc.pid, 5.0)
    assert proc.poll() is not None and find_parts(home) == {}
