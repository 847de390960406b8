"""Measuring a profile: the texts sent, the load target, and the worker's peak memory."""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import msgpack

from lorafleet.core import settings
from lorafleet.tune.config import TuneError
from lorafleet.tune.loadgen import LoadResult, Target

SERVED_NAME = "tuned"
_FALLBACK_TEXTS = [
    "Der Verkäufer einer Sache ist verpflichtet, dem Käufer die Sache zu übergeben.",
    "Die Kündigung des Arbeitsverhältnisses bedarf zu ihrer Wirksamkeit der Schriftform.",
    "Wer vorsätzlich oder fahrlässig das Eigentum eines anderen verletzt, ist zum Ersatz verpflichtet.",
    "Arbeitnehmer haben in jedem Kalenderjahr Anspruch auf bezahlten Erholungsurlaub.",
    "Der Mieter ist verpflichtet, dem Vermieter die vereinbarte Miete zu entrichten.",
]


def load_texts(n: int = 400, seed: int = 0) -> list[str]:
    """Single sentences of 5–25 words from the statutes (LORAFLEET_DATA_DIR), else a built-in handful."""
    try:
        files = sorted((settings.data_dir() / "gesetze").glob("*.md"))
    except Exception:
        files = []
    sentences: list[str] = []
    for f in files[:6]:
        text = " ".join(line.strip() for line in f.read_text(errors="replace").splitlines()
                        if line.strip() and not line.lstrip().startswith(("#", ":", "-", "|")))
        for s in re.split(r"(?<=[.;])\s+", text):
            words = s.split()
            if 5 <= len(words) <= 25:
                sentences.append(" ".join(words))
    if len(sentences) < 20:
        return list(_FALLBACK_TEXTS)
    rng = random.Random(seed)
    rng.shuffle(sentences)
    return sentences[:n]


def start_cluster(fleet: Any, home: Path, timeout: float) -> Any:
    """A started private tuning cluster (nats-server, gateway, one worker) serving `fleet`."""
    from lorafleet.nats.server import free_port
    from lorafleet.ops.cluster import ClusterError, LocalCluster

    cluster = LocalCluster(fleet, workers=1, port=0, home=home, nats_port=free_port())
    try:
        cluster.start(timeout=timeout)
    except ClusterError as exc:
        raise TuneError(f"the tuning cluster did not start: {exc}") from exc
    return cluster


def make_target(gateway_url: str, model: str, texts: list[str]) -> Target:
    m = re.match(r"^http://([^:/]+):(\d+)", gateway_url)
    if not m:
        raise TuneError(f"unsupported gateway URL {gateway_url}")
    bodies = [msgpack.packb({"inputs": [t]}) for t in texts]
    return Target(m.group(1), int(m.group(2)), f"/v1/encode/{model}", lambda i: bodies[i % len(bodies)])


class PeakMemory:
    """Samples a process (and its children) every `interval_s` for peak RSS, and GPU memory when there is one."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak_rss = 0
        self.peak_gpu_mb: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)
        self._nvidia = shutil.which("nvidia-smi")

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        import psutil

        try:
            proc = psutil.Process(self.pid)
        except psutil.Error:
            return
        ticks = 0
        while not self._stop.is_set():
            try:
                rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
                self.peak_rss = max(self.peak_rss, rss)
            except psutil.Error:
                return
            if self._nvidia and ticks % 10 == 0:  # nvidia-smi is slow; once a second is enough
                gpu = _gpu_mb(self._nvidia, self.pid)
                if gpu is not None:
                    self.peak_gpu_mb = max(self.peak_gpu_mb or 0.0, gpu)
            ticks += 1
            self._stop.wait(self.interval_s)


def _gpu_mb(nvidia_smi: str, pid: int) -> float | None:
    try:
        out = subprocess.run([nvidia_smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    total = [float(used) for line in out.splitlines() if "," in line
             for p, used in [line.split(",", 1)] if p.strip() == str(pid)]
    return sum(total) if total else None


def run_async(coro: object) -> LoadResult:
    try:
        import uvloop

        return uvloop.run(coro)  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)  # type: ignore[arg-type]


