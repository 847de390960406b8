"""The thread plan (lorafleet/ops/threads.py): how a host's CPUs are split among its processes, and who wins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorafleet.core.config import BaseModelSpec, FleetConfig, WorkerConfig
from lorafleet.models.device import nvidia_gpu_present
from lorafleet.ops import cluster as cluster_module
from lorafleet.ops.cluster import ClusterError, LocalCluster, default_workers
from lorafleet.ops.threads import (
    AUTO_WORKERS_MAX,
    POOL_VARIABLES,
    auto_workers,
    available_cpus,
    cgroup_cpu_limit,
    plan_threads,
    pool_env,
)


@pytest.mark.parametrize(("cpus", "workers", "expected"), [(2, 1, 2), (2, 2, 1), (8, 3, 2), (1, 4, 1), (16, 0, 16)])
def test_cpus_are_split_among_the_workers(cpus: int, workers: int, expected: int) -> None:
    plan = plan_threads(cpus, workers, environ={})
    assert plan.worker == expected
    assert plan.gateway == 1
    assert f"{cpus} CPU(s)" in plan.describe()


def test_an_explicit_count_wins_over_the_environment_and_the_split() -> None:
    assert plan_threads(8, 1, 3, environ={"OMP_NUM_THREADS": "5"}).worker == 3
    plan = plan_threads(8, 1, environ={"OMP_NUM_THREADS": "5"})
    assert plan.worker == 5 and "OMP_NUM_THREADS" in plan.reason


@pytest.mark.parametrize("value", ["", "0", "-2", "four"])
def test_an_unusable_omp_num_threads_is_ignored(value: str) -> None:
    assert plan_threads(4, 2, environ={"OMP_NUM_THREADS": value}).worker == 2


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        plan_threads(4, 1, 0, environ={})
    with pytest.raises(ValueError, match="cpus"):
        plan_threads(0, 1, environ={})
    with pytest.raises(ClusterError, match="--worker-threads"):
        LocalCluster(FleetConfig(), workers=1, worker_threads=0)


def test_cgroup_quota_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "cpu.max"
    v1 = (tmp_path / "quota", tmp_path / "period")
    v2.write_text("150000 100000\n")
    assert cgroup_cpu_limit(v2, v1) == 1.5
    v2.write_text("max 100000\n")
    assert cgroup_cpu_limit(v2, v1) is None
    v2.unlink()
    assert cgroup_cpu_limit(v2, v1) is None  # no cgroup files: no limit
    v1[0].write_text("200000\n")
    v1[1].write_text("100000\n")
    assert cgroup_cpu_limit(v2, v1) == 2.0
    v1[0].write_text("-1\n")  # v1's "unlimited"
    assert cgroup_cpu_limit(v2, v1) is None


def test_available_cpus_is_within_the_machine() -> None:
    assert 1 <= available_cpus() <= (os.cpu_count() or 1)


@pytest.mark.parametrize(("cpus", "threads", "env", "expected"), [
    (1, None, {}, 1), (2, None, {}, 2), (3, None, {}, 3), (16, None, {}, AUTO_WORKERS_MAX),
    (2, 2, {}, 1), (8, 2, {}, 4), (8, None, {"OMP_NUM_THREADS": "4"}, 2), (2, 4, {}, 1)])
def test_auto_workers_one_per_cpu_or_per_explicit_thread_count(cpus: int, threads: int | None, env: dict[str, str],
                                                              expected: int) -> None:
    n, why = auto_workers(cpus, None, threads, env)
    assert n == expected
    assert f"{cpus} CPU(s)" in why


def test_auto_workers_is_one_when_told_why() -> None:
    assert auto_workers(8, "1 worker: it owns the GPU", None, {}) == (1, "1 worker: it owns the GPU")


def test_default_workers_reads_the_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_module, "available_cpus", lambda: 2)
    monkeypatch.setattr("lorafleet.ops.cluster.nvidia_gpu_present", lambda: False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_workers(FleetConfig())[0] == 2  # the default fleet computes in the worker
    assert default_workers(FleetConfig(worker=WorkerConfig(threads=2)))[0] == 1
    assert default_workers(FleetConfig(worker=WorkerConfig(device="cuda")))[0] == 1
    engine = FleetConfig(bases=[BaseModelSpec(name="llm", source="SmolLM2-135M-Instruct", runtime="vllm")])
    n, why = default_workers(engine)
    assert (n, "llm" in why) == (1, True)  # a vLLM engine takes the host's cores itself
    monkeypatch.setattr("lorafleet.ops.cluster.nvidia_gpu_present", lambda: True)
    assert default_workers(FleetConfig())[1] == "1 worker: it owns the GPU"


def test_nvidia_gpu_present_reads_the_driver_listing(tmp_path: Path) -> None:
    assert not nvidia_gpu_present(tmp_path / "absent")
    (tmp_path / "gpus").mkdir()
    assert not nvidia_gpu_present(tmp_path / "gpus")
    (tmp_path / "gpus" / "0000:01:00.0").mkdir()
    assert nvidia_gpu_present(tmp_path / "gpus")


def test_the_cluster_gives_each_worker_its_share_and_the_gateway_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    c = LocalCluster(FleetConfig(), workers=2)
    assert c.threads.worker == max(1, available_cpus() // 2)
    assert c.threads.gateway == 1
    fixed = LocalCluster(FleetConfig(worker=WorkerConfig(threads=3)), workers=2)
    assert fixed.threads.worker == 3  # the fleet's worker.threads
    assert LocalCluster(FleetConfig(worker=WorkerConfig(threads=3)), workers=2, worker_threads=1).threads.worker == 1


def test_pool_env_sizes_torch_in_a_fresh_process() -> None:
    """The mechanism the worker relies on: the variables set before torch loads size its OpenMP team."""
    assert set(POOL_VARIABLES) <= set(pool_env(1))
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         env={**os.environ, **pool_env(1)}, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "1"


def test_worker_refuses_a_bad_thread_count() -> None:
    out = subprocess.run([sys.executable, "-m", "lorafleet.sidecar", "--fleet", "-", "--threads", "0"],
                         input="", capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--threads must be at least 1" in out.stderr
