"""Shared helpers of the benchmarks: inputs, machine description, command line, JSON output (process control:
bench/processes.py, re-exported here)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.bench.processes import exit_on_sigterm as exit_on_sigterm
from lorafleet.bench.processes import spawn as spawn
from lorafleet.bench.processes import stop_all as stop_all

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"


@dataclass
class Endpoint:
    """A contender's HTTP route: what the load generator and the correctness check call."""

    name: str
    host: str
    port: int
    path: str

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{self.path}"


def german_sentences(n: int, seed: int = 0, min_words: int = 5, max_words: int = 20) -> list[str]:
    """Statute sentences of `min_words`–`max_words` words (LORAFLEET_DATA_DIR), ~32 MiniLM tokens each."""
    from lorafleet.tune.probe import load_texts

    pool = [t for t in load_texts(n=max(4 * n, 400), seed=seed) if min_words <= len(t.split()) <= max_words]
    if not pool:
        raise RuntimeError("no statute sentences found; set LORAFLEET_DATA_DIR to the folder holding gesetze/")
    rng = random.Random(seed)
    while len(pool) < n:
        pool.append(rng.choice(pool))
    return pool[:n]


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gb = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_gb = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    info: dict[str, Any] = {"cpus": os.cpu_count(), "cpu": cpu, "memory_gib": mem_gb,
                            "python": platform.python_version(), "platform": platform.platform(),
                            "loadavg_start": loadavg()}
    with contextlib.suppress(ImportError):
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return info


def write_json(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")
    tmp.replace(path)
    return path


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line: `python -m lorafleet.bench.NAME`, its docstring's first paragraph as description."""
    return argparse.ArgumentParser(prog=f"python -m lorafleet.bench.{name}", description=(doc or "").split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def run_head(benchmark: str, quick: bool, info: dict[str, Any]) -> dict[str, Any]:
    """The keys every result file opens with: which benchmark, when, how quick, the machine and its load at the end."""
    return {"benchmark": benchmark, "when": stamp(), "quick": quick, "machine": {**info, "loadavg_end": loadavg()}}


def finish(out: Path, result: dict[str, Any], print_table: Callable[[dict[str, Any]], None]) -> int:
    """Write the result file, print its table and where it went (with `wall_s`); the exit code 0."""
    write_json(out, result)
    print_table(result)
    print(f"\nwrote {out} ({result['wall_s']:.0f}s)")
    return 0


def say(text: str) -> None:
    import sys

    print(text, file=sys.stderr, flush=True)


def fmt(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def run_in_vllm_venv(venv: Path, work: Path, script: str, spec: dict[str, Any], *, timeout: float) -> Any:
    """Run `script` (it reads spec.json, prints one `REFERENCE <json>` line) in vLLM's venv; that JSON.

    The support files the worker's engines get come too (the sitecustomize that vLLM on Intel CPUs needs)."""
    import subprocess

    from lorafleet.sidecar.vllm_files import write_support_files
    from lorafleet.sidecar.vllm_install import venv_python

    run_dir = write_support_files(work)
    (run_dir / "reference.py").write_text(script)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(run_dir), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run([str(venv_python(venv)), str(run_dir / "reference.py"), str(run_dir / "spec.json")],
                          env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REFERENCE ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the vLLM reference script failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("REFERENCE "))
