"""How many threads each process on a machine uses: one plan for `lorafleet up`, the worker and the gateway.

Left alone, every library sizes its pool to the whole machine: torch's OpenMP team to the physical cores
(ignoring a container's CPU quota), OpenBLAS to the cores again in every process that imports numpy, the
Rust tokenizers to the cores on the first batch. With two workers and a gateway on one host that is
several teams per core, and an OpenMP team that loses a core to another process waits at every barrier:
on a 2-core machine a team of 2 sharing its cores ran >10x slower than a team of 1 (MEASURED.md).

The plan: the CPUs this process may use (affinity, then the cgroup quota, which Kubernetes limits set)
are divided among the workers on the host; the gateway, which only parses, counts tokens and moves
bytes, gets one thread for each pool. A thread count the user set (a flag, the fleet's
`worker.threads`, or OMP_NUM_THREADS in the environment) always wins.

How many workers `lorafleet up` starts when not told (`auto_workers`): on a CPU host whose bases all
compute inside the worker, one single-threaded worker per CPU (up to AUTO_WORKERS_MAX). Two workers of
one thread served 1.18-1.21x (fp32) and 1.08-1.29x (bf16) the requests of one worker of two threads on a
2-CPU host (docs/benchmarks.md, 1b): while one computes, the other pulls, tokenises and replies, and
no OpenMP team waits at a barrier for a core another process took. Where a base runs its own engine
(vLLM, which takes the host's cores itself) or the host has a GPU, one worker.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# Every pool a lorafleet process may start: torch (OpenMP, MKL), numpy (OpenBLAS), tokenizers (rayon).
POOL_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")
GATEWAY_THREADS = 1
# Measured at 2 CPUs only; each worker holds its own copy of every base, so the default stays small beyond.
AUTO_WORKERS_MAX = 4

_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def cgroup_cpu_limit(v2: Path = _CGROUP_V2, v1: tuple[Path, Path] = _CGROUP_V1) -> float | None:
    """CPUs the cgroup quota allows (a Kubernetes `limits.cpu`), or None when unlimited or unreadable."""
    try:
        quota, period = v2.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us, period_us = int(v1[0].read_text()), int(v1[1].read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def available_cpus() -> int:
    """The CPUs this process can use: its affinity mask, capped by the cgroup quota (rounded up, at least 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    """Threads per process on one host; `reason` says where the worker count came from, for the logs."""

    cpus: int
    workers: int
    worker: int
    gateway: int
    reason: str

    def describe(self) -> str:
        return (f"{self.worker} torch thread(s) per worker ({self.reason}), {self.gateway} per gateway pool")


def plan_threads(cpus: int, workers: int, worker_threads: int | None = None,
                 environ: Mapping[str, str] | None = None) -> ThreadPlan:
    """Split `cpus` among `workers` torch teams; an explicit count, else OMP_NUM_THREADS, wins."""
    if cpus < 1:
        raise ValueError(f"cpus must be at least 1, got {cpus}")
    env = os.environ if environ is None else environ
    if worker_threads is not None:
        if worker_threads < 1:
            raise ValueError(f"worker threads must be at least 1, got {worker_threads}")
        return ThreadPlan(cpus, workers, worker_threads, GATEWAY_THREADS, "set explicitly")
    from_env = _positive_int(env.get("OMP_NUM_THREADS"))
    if from_env is not None:
        return ThreadPlan(cpus, workers, from_env, GATEWAY_THREADS, "OMP_NUM_THREADS in the environment")
    share = max(1, cpus // max(1, workers))
    return ThreadPlan(cpus, workers, share, GATEWAY_THREADS,
                      f"{cpus} CPU(s) available / {max(1, workers)} worker(s) on this host")


def auto_workers(cpus: int, single: str | None = None, worker_threads: int | None = None,
                 environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Workers to start when the user gave no count, and why: one per `worker_threads` (else OMP_NUM_THREADS,
    else 1) CPUs, at most AUTO_WORKERS_MAX; 1 when `single` says why only one makes sense."""
    if single:
        return 1, single
    env = os.environ if environ is None else environ
    threads = worker_threads or _positive_int(env.get("OMP_NUM_THREADS")) or 1
    n = max(1, min(AUTO_WORKERS_MAX, cpus // threads))
    return n, f"{n} worker(s): {cpus} CPU(s), {threads} thread(s) each, at most {AUTO_WORKERS_MAX}"


def pool_env(threads: int) -> dict[str, str]:
    """The environment that sizes every pool of a process to `threads` (read by each library at start-up)."""
    env = {name: str(threads) for name in POOL_VARIABLES}
    # The tokenizers' own switch: without it, the first batch encode starts a pool of one thread per core.
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def apply_to_environ(threads: int, environ: dict[str, str] | None = None) -> None:
    """Set the pool sizes for this process before torch or numpy is imported; values already set win."""
    env = os.environ if environ is None else environ
    for name, value in pool_env(threads).items():
        env.setdefault(name, value)


def _positive_int(raw: str | None) -> int | None:
    try:
        value = int(raw) if raw else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None
