"""Serving against its ceiling and its peers, side by side in one run (issues 2, 6 §2 and 19).

Same packaged all-MiniLM-L6-v2, same inputs (German statute sentences of 5–20 words, one per
request), same load generator (lorafleet.tune.loadgen, closed loop) against:

- raw: in-process `SentenceTransformer.encode` at batch 1 and at its best batch size (the ceiling),
  with torch's default threads unless --threads is given;
- by default, the path users run: one cluster started exactly as `lorafleet up` starts it (the fleet
  `lorafleet up` would serve, its thread plan, authentication on, no environment of ours), called on
  the OpenAI route `/v1/embeddings` with `encoding_format` `float` (`openai-float`) and `base64`
  (`openai-base64`, what the official client sends) and on the MessagePack route (`msgpack`), the
  three routes taking turns at each concurrency; `--profile DIR` records py-spy flame graphs of the
  gateway and the worker during the highest concurrency of each route;
- lorafleet: the local cluster (nats-server + gateway + 1 worker), `POST /v1/encode/{model}`, as `lorafleet up`
  starts it (NATS authentication on); `lorafleet-tls` the same with TLS on every NATS connection, and
  `lorafleet-open` without authentication (`--insecure-no-auth`): what security costs, side by side;
- naive: a uvicorn app that encodes each request alone on arrival (bench/naive_server.py);
- infinity: infinity-emb 0.0.78 in its own venv (bench/infinity.py; installed on first use).

Only one server runs at a time. Each is checked to return the raw model's embeddings
(cosine > 0.999) before it is timed. Raw encode is measured again at the end to show drift.

    python -m lorafleet.bench.serve [--quick] [--profile docs/img/profile]     # the user's path
    python -m lorafleet.bench.serve --threads 1 --contenders lorafleet,naive,infinity [--point-s 8]
    python -m lorafleet.bench.serve --contenders lorafleet-open,lorafleet-tls,lorafleet-open,lorafleet-tls \
        --concurrency 1 --concurrency 32          # auth+TLS against none, alternated (medians compared)

A contender named twice is measured twice (`name#2`), so two variants can alternate against drift.
`--precision fp32,bf16` serves the base of each lorafleet contender at each precision in turn (`lorafleet@fp32`,
`lorafleet@bf16`), side by side in one run; without it the base is served at `auto` (the guard's choice).

    python -m lorafleet.bench.serve --contenders lorafleet --precision fp32,bf16 --concurrency 8 --point-s 3
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import orjson

from lorafleet.bench.common import (
    RESULTS_DIR,
    Endpoint,
    finish,
    fmt,
    german_sentences,
    loadavg,
    machine_info,
    parser,
    run_head,
    say,
)
from lorafleet.bench.processes import exit_on_sigterm, spawn, stop_all
from lorafleet.bench.serve_report import print_table, summarise
from lorafleet.tune.loadgen import LoadResult, Target, closed_loop

MODEL_NAME = "all-MiniLM-L6-v2"
COSINE_MIN = 0.999
USER_ROUTES = ("openai-float", "openai-base64", "msgpack")
ALL_CONTENDERS = (*USER_ROUTES, "lorafleet", "lorafleet-tls", "lorafleet-open", "naive", "infinity")
SECURITY = {"lorafleet-open": {"auth": False, "tls": False}, "lorafleet": {"auth": True, "tls": False},
            "lorafleet-tls": {"auth": True, "tls": True}}


# -- raw encode ---------------------------------------------------------------------------------

def _timed_loop(fn: Callable[[], None], seconds: float, min_calls: int = 5) -> list[float]:
    """Call `fn` repeatedly for `seconds` (at least `min_calls` times); per-call latencies in ms."""
    lat: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(lat) < min_calls:
        t0 = time.perf_counter()
        fn()
        lat.append((time.perf_counter() - t0) * 1000.0)
    return lat


def measure_raw(model: Any, texts: list[str], batch_sizes: list[int], seconds: float) -> dict[str, Any]:
    """Sentences/s at each batch size; batch 1 also gives the per-call latency (the c=1 floor)."""
    out: dict[str, Any] = {"by_batch": {}}
    model.encode(texts[:8], show_progress_bar=False)  # warm up
    for b in batch_sizes:
        pos = [0]

        def one(b: int = b, pos: list[int] = pos) -> None:
            i = pos[0]
            chunk = [texts[(i + k) % len(texts)] for k in range(b)]
            pos[0] = (i + b) % len(texts)
            model.encode(chunk, batch_size=b, show_progress_bar=False)

        lat = _timed_loop(one, seconds)
        sps = b * len(lat) / (sum(lat) / 1000.0)
        out["by_batch"][str(b)] = {"sentences_per_s": round(sps, 1),
                                   "call_p50_ms": round(float(np.percentile(lat, 50)), 2),
                                   "call_p99_ms": round(float(np.percentile(lat, 99)), 2), "calls": len(lat)}
        say(f"  raw encode batch {b:>3}: {sps:6.1f} sentences/s, call p50 {np.percentile(lat, 50):.1f} ms")
    best = max(out["by_batch"].items(), key=lambda kv: kv[1]["sentences_per_s"])
    out["best_batch"] = int(best[0])
    out["best_sentences_per_s"] = best[1]["sentences_per_s"]
    if "1" in out["by_batch"]:
        out["batch1_sentences_per_s"] = out["by_batch"]["1"]["sentences_per_s"]
        out["batch1_p50_ms"] = out["by_batch"]["1"]["call_p50_ms"]
    return out


def measure_ceiling(model: Any, texts: list[str], batch_sizes: list[int], seconds: float,
                    precision: str = "fp32") -> dict[str, Any]:
    """The ceiling the issue names: `encode(texts, batch_size=b)` over all the sentences at once, which sorts them
    by length before cutting batches (almost no padding), at each batch size; sentences/s and the best. `model` is
    cast to `precision` (a copy, so the fp32 model stays as it is)."""
    import copy

    import torch

    if precision != "fp32":
        model = copy.deepcopy(model).to({"bf16": torch.bfloat16, "fp16": torch.float16}[precision])
    model.encode(texts[:16], show_progress_bar=False, convert_to_tensor=True)  # warm up
    out: dict[str, Any] = {"precision": precision, "by_batch": {}, "per_cpu_s": {}}
    for b in batch_sizes:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        # .cpu(): on a GPU the timing must include the work, not just its launch.
        lat = _timed_loop(lambda b=b: model.encode(texts, batch_size=b, show_progress_bar=False,  # type: ignore[misc]
                                                   convert_to_tensor=True).float().cpu(), seconds, min_calls=1)
        sps = len(texts) * len(lat) / (sum(lat) / 1000.0)
        out["by_batch"][str(b)] = round(sps, 1)
        # Per CPU second of this process too: on a shared machine the wall-clock figure is the CPU share it got.
        cpu = time.process_time() - cpu0
        out["per_cpu_s"][str(b)] = round(len(texts) * len(lat) / cpu, 1) if cpu > 0 else None
        out.setdefault("cores", {})[str(b)] = round(cpu / (time.perf_counter() - wall0), 2)
        say(f"  ceiling ({precision}, sorted by encode) batch {b:>3}: {sps:6.1f} sentences/s, "
            f"{out['per_cpu_s'][str(b)]} per CPU second")
    best = max(out["by_batch"].items(), key=lambda kv: kv[1])
    out["best_batch"], out["best_sentences_per_s"] = int(best[0]), best[1]
    out["best_per_cpu_s"] = max((v for v in out["per_cpu_s"].values() if v), default=None)
    return out


def _native_reduced() -> frozenset[str]:
    from lorafleet.models.precision import native_cpu_precisions, read_cpuinfo

    return native_cpu_precisions(read_cpuinfo())


# -- contenders ---------------------------------------------------------------------------------

@dataclass
class Contender(Endpoint):
    content_type: str
    body: Callable[[str], bytes]
    vectors: Callable[[bytes], np.ndarray]
    stop: Callable[[], None]
    started_s: float = 0.0
    pids: tuple[int, ...] = ()  # the server's processes (their children are counted too): CPU per point

    def target(self, texts: list[str]) -> Target:
        bodies = [self.body(t) for t in texts]
        return Target(self.host, self.port, self.path, lambda i: bodies[i % len(bodies)], self.content_type)

    def embed(self, texts: list[str]) -> np.ndarray:
        rows = []
        with httpx.Client(timeout=60) as client:
            for t in texts:
                r = client.post(self.url, content=self.body(t),
                                headers={"Content-Type": self.content_type})
                if r.status_code != 200:
                    raise RuntimeError(f"{self.name}: HTTP {r.status_code}: {r.text[:300]}")
                rows.append(self.vectors(r.content)[0])
        return np.stack(rows)


def _msgpack_body(text: str) -> bytes:
    return msgpack.packb({"inputs": [text]})


def _msgpack_vectors(content: bytes) -> np.ndarray:
    d = msgpack.unpackb(content)
    return np.stack([np.frombuffer(v, dtype="<f4") for v in d["vectors"]])


def _infinity_body(text: str) -> bytes:
    return orjson.dumps({"model": MODEL_NAME, "input": [text], "encoding_format": "base64"})


def _openai_body(encoding_format: str) -> Callable[[str], bytes]:
    # A string input, as the official client sends one text.
    return lambda text: orjson.dumps({"model": MODEL_NAME, "input": text, "encoding_format": encoding_format})


def _openai_vectors(content: bytes) -> np.ndarray:
    data = orjson.loads(content)["data"]
    rows = []
    for item in data:
        emb = item["embedding"]
        rows.append(np.frombuffer(base64.b64decode(emb), dtype="<f4") if isinstance(emb, str)
                    else np.asarray(emb, dtype=np.float32))
    return np.stack(rows)


def _wait_http(url: str, proc: subprocess.Popen[bytes] | None, timeout: float, log: Path | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"server exited with code {proc.returncode} while starting:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(f"{url} not ready within {timeout:.0f}s" + (f"; see {log}" if log else ""))


def _spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return spawn(argv, log, env)


def _stopper(proc: subprocess.Popen[bytes]) -> Callable[[], None]:
    def stop() -> None:
        stop_all([proc], timeout=10.0)

    return stop


def thread_env(threads: int) -> dict[str, str]:
    # The same intra-op thread count for every contender: with other load on 2 cores, torch's
    # OpenMP team of 2 can run >10x slower than 1 thread, so this is set explicitly, never left implicit.
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def start_lorafleet(work: Path, profile: dict[str, Any] | None, threads: int, name: str = "lorafleet",
                    precision: str = "auto", device: str = "cpu") -> Contender:
    from lorafleet.core.config import BaseModelSpec, FleetConfig, GatewayConfig, ServingProfile, WorkerConfig
    from lorafleet.models.precision import check_fleet_precisions
    from lorafleet.nats.server import free_port
    from lorafleet.ops.cluster import LocalCluster

    prof = ServingProfile(**(profile or {}))
    fleet = FleetConfig(bases=[BaseModelSpec(name=MODEL_NAME, precision=precision)],  # type: ignore[arg-type]
                        gateway=GatewayConfig(port=0, default_deadline_s=60.0),
                        worker=WorkerConfig(profile=prof, device=device))
    check_fleet_precisions(fleet)  # as `lorafleet up` does: an unsupported precision is not started
    t0 = time.monotonic()
    home = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    cluster = LocalCluster(fleet, workers=1, port=0, home=home, nats_port=free_port(),
                           extra_env=thread_env(threads), **SECURITY[name]).start(timeout=240)
    c = Contender(name, cluster.host, cluster.port, f"/v1/encode/{MODEL_NAME}", "application/msgpack",
                  _msgpack_body, _msgpack_vectors, cluster.stop,
                  pids=(*(proc.pid for proc in cluster.procs.values()), cluster.nats.pid))
    c.started_s = time.monotonic() - t0
    return c


def start_user_path(work: Path, routes: list[str], threads: int | None,
                    precision: str | None = None) -> tuple[list[Contender], Any]:
    """One cluster as `lorafleet up` starts it, and a contender per route on it (they share it: stop the cluster).

    `precision` (not `auto`) pins what the base's `precision: auto` resolves to (LORAFLEET_AUTO_PRECISION), so the
    same fleet file is served at fp32 beside the guard's choice; the contenders are then named `route@precision`."""
    from lorafleet.core.settings import DEFAULT_FLEET
    from lorafleet.models.precision import AUTO_ENV
    from lorafleet.nats.server import free_port
    from lorafleet.ops.cluster import LocalCluster, default_workers, load_fleet

    t0 = time.monotonic()
    home = Path(tempfile.mkdtemp(prefix="user-path-", dir=work))
    pinned, _, variant = (precision or "").partition(":")
    env = {**(thread_env(threads) if threads else {}),
           **({AUTO_ENV: pinned} if pinned and pinned != "auto" else {}),
           # `auto:old`, `fp32:old`: the worker as before issue 27 (one batch per pull, one forward pass per batch);
           # `:nocuts` (window of 2, one pass) / `:nowindow` / `:window` vary one; `:b32` serves batches of 32.
           **({"LORAFLEET_SORT_WINDOW": "1"} if variant in ("old", "nowindow") else {"LORAFLEET_SORT_WINDOW": "2"}
              if variant in ("nocuts", "window") else {}),
           **({"LORAFLEET_PASS_CUTS": "0"} if variant in ("old", "nocuts") else {}),
           **({"LORAFLEET_PASS_CUTS": "1"} if variant == "cuts" else {}),
           # `:passive`: OpenMP threads sleep at a barrier instead of spinning (libgomp's OMP_WAIT_POLICY).
           **({"OMP_WAIT_POLICY": "PASSIVE"} if variant == "passive" else {})}
    fleet = load_fleet(DEFAULT_FLEET if DEFAULT_FLEET.is_file() else None)
    profile: dict[str, int] = {}
    if variant.startswith("b") and variant[1:].isdigit():  # `auto:b32`: the fleet file with another batch size
        profile["max_batch_items"] = int(variant[1:])
    if variant == "ahead":  # `auto:ahead`: one batch pulled while another computes
        profile["batches_in_flight"] = 1
    # As many workers as `lorafleet up` starts by default; `auto:w1`, `fp32:w2`: N (`lorafleet up --workers N`). The
    # thread plan splits the CPUs among them.
    workers = int(variant[1:]) if variant.startswith("w") and variant[1:].isdigit() else \
        default_workers(fleet, threads)[0]
    if profile:
        worker = fleet.worker.model_copy(update={"profile": fleet.worker.profile.model_copy(update=profile)})
        fleet = fleet.model_copy(update={"worker": worker})
    # Only the ports differ from `lorafleet up` (free ones, so a running cluster is left alone).
    cluster = LocalCluster(fleet, workers=workers, port=0, home=home, nats_port=free_port(), extra_env=env or None,
                           supervise=True)
    cluster.start(timeout=240)
    started = time.monotonic() - t0
    out = []
    for route in routes:
        name = f"{route}@{precision}" if precision else route
        if route == "msgpack":
            c = Contender(name, cluster.host, cluster.port, f"/v1/encode/{MODEL_NAME}", "application/msgpack",
                          _msgpack_body, _msgpack_vectors, lambda: None)
        else:
            c = Contender(name, cluster.host, cluster.port, "/v1/embeddings", "application/json",
                          _openai_body(route.removeprefix("openai-")), _openai_vectors, lambda: None)
        c.started_s = started
        out.append(c)
    return out, cluster


def _py_spy() -> str | None:
    exe = Path(sys.executable).parent / "py-spy"
    return str(exe) if exe.exists() else shutil.which("py-spy")


def profile_during(pids: dict[str, int], seconds: float, out_dir: Path, label: str) -> list[subprocess.Popen[bytes]]:
    """py-spy flame graphs (SVG) of each process for `seconds`, sampling without pausing it (--nonblocking)."""
    exe = _py_spy()
    if exe is None:
        raise RuntimeError("--profile needs py-spy: pip install py-spy")
    out_dir.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate",
                              "100", "--nonblocking", "--format", "flamegraph", "--output",
                              str(out_dir / f"{label}-{part}.svg")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for part, pid in pids.items()]


def _median_point(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Of several rounds at one concurrency, the round with the median throughput (the lower middle of an even
    count), so a report's row is one real measurement."""
    ranked = sorted(points, key=lambda p: p["throughput_rps"])
    return {**ranked[(len(ranked) - 1) // 2], "rounds_rps": [p["throughput_rps"] for p in points]}


def measure_user_path(contenders: list[tuple[Contender, Any]], texts: list[str], concurrencies: list[int],
                      point_s: float, warmup_s: float, profile_dir: Path | None,
                      rounds: int = 1) -> dict[str, list[dict[str, Any]]]:
    """The routes (of one or more clusters) take turns at each concurrency, `rounds` times (drift hits them alike);
    CPU seconds per process per point. Each concurrency's point is the round with the median throughput."""
    import psutil

    procs: dict[str, dict[str, Any]] = {}
    for c, cluster in contenders:
        parts = {**{name: proc.pid for name, proc in cluster.procs.items()}, "nats-server": cluster.nats.pid}
        procs[c.name] = {name: psutil.Process(pid) for name, pid in parts.items()}
    targets = {c.name: c.target(texts) for c, _ in contenders}
    if warmup_s:
        for t in targets.values():
            _run(closed_loop(t, max(8, min(concurrencies[-1], 32)), warmup_s))
    points: dict[str, list[dict[str, Any]]] = {c.name: [] for c, _ in contenders}
    for conc in concurrencies:
        per_round: dict[str, list[dict[str, Any]]] = {c.name: [] for c, _ in contenders}
        for rnd in range(rounds):
            for c, _ in contenders:
                ps = procs[c.name]
                spies = (profile_during({k: p.pid for k, p in ps.items() if k != "nats-server"}, point_s,
                                        profile_dir, f"{c.name}-c{conc}")
                         if profile_dir is not None and conc == concurrencies[-1] and rnd == 0 else [])
                cpu0 = {k: sum(p.cpu_times()[:2]) for k, p in ps.items()}
                r = _run(closed_loop(targets[c.name], conc, point_s))
                s = r.summary()
                s["statuses"] = {str(k): v for k, v in r.statuses.items()}
                s["cores_used"] = {k: round((sum(p.cpu_times()[:2]) - cpu0[k]) / point_s, 2) for k, p in ps.items()}
                s["loadavg"] = loadavg()
                per_round[c.name].append(s)
                for spy in spies:
                    spy.wait(timeout=point_s + 60)
                say(f"  {c.name:<18} c={conc:<4} {r.throughput:7.1f} req/s  p50 {fmt(r.percentile(50))} ms  "
                    f"p99 {fmt(r.percentile(99))} ms  errors {r.errors}  cores {s['cores_used']}")
        for name, pts in per_round.items():
            points[name].append(_median_point(pts) if len(pts) > 1 else pts[0])
    return points


def start_naive(work: Path, model_dir: str, threads: int) -> Contender:
    from lorafleet.nats.server import free_port

    port = free_port()
    log = work / "naive.log"
    t0 = time.monotonic()
    proc = _spawn([sys.executable, "-m", "lorafleet.bench.naive_server", "--model", model_dir, "--port", str(port)],
                  log, thread_env(threads))
    try:
        _wait_http(f"http://127.0.0.1:{port}/healthz", proc, 120, log)
    except BaseException:
        _stopper(proc)()
        raise
    c = Contender("naive", "127.0.0.1", port, "/encode", "application/msgpack", _msgpack_body, _msgpack_vectors,
                  _stopper(proc), pids=(proc.pid,))
    c.started_s = time.monotonic() - t0
    return c


def start_infinity(work: Path, model_dir: str, batch_size: int, threads: int,
                   dtype: str | None = None) -> Contender:
    from lorafleet.bench.infinity import ensure_venv, server_argv
    from lorafleet.nats.server import free_port

    exe = ensure_venv(say=say)
    port = free_port()
    log = work / "infinity.log"
    t0 = time.monotonic()
    env = {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
           **thread_env(threads)}
    proc = _spawn(server_argv(exe, model_dir, port, batch_size, dtype), log, env)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, 180, log)
    except BaseException:
        _stopper(proc)()
        raise
    c = Contender("infinity", "127.0.0.1", port, "/embeddings", "application/json", _infinity_body,
                  _openai_vectors, _stopper(proc), pids=(proc.pid,))
    c.started_s = time.monotonic() - t0
    return c


def check_embeddings(c: Contender, texts: list[str], ref: np.ndarray) -> float:
    got = c.embed(texts)
    if got.shape != ref.shape:
        raise RuntimeError(f"{c.name} returned shape {got.shape}, expected {ref.shape}")
    cos = np.sum(got * ref, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    return float(cos.min())


def _run(coro: Any) -> LoadResult:
    import uvloop

    return uvloop.run(coro)


def _cpu_seconds(pids: tuple[int, ...]) -> float:
    """User + system CPU seconds of `pids` and their living children (a worker's engine, infinity's workers)."""
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            for p in (proc, *proc.children(recursive=True)):
                with contextlib.suppress(psutil.Error):
                    total += sum(p.cpu_times()[:2])
    return total


def measure_contender(c: Contender, texts: list[str], concurrencies: list[int], point_s: float,
                      warmup_s: float) -> list[dict[str, Any]]:
    target = c.target(texts)
    if warmup_s:
        _run(closed_loop(target, max(8, min(concurrencies[-1], 32)), warmup_s))
    points = []
    for conc in concurrencies:
        cpu0 = _cpu_seconds(c.pids)
        r = _run(closed_loop(target, conc, point_s))
        s = r.summary()
        s["statuses"] = {str(k): v for k, v in r.statuses.items()}
        if c.pids:
            s["cores_used"] = {"server": round((_cpu_seconds(c.pids) - cpu0) / point_s, 2)}
        s["loadavg"] = loadavg()
        points.append(s)
        say(f"  {c.name:<9} c={conc:<4} {r.throughput:7.1f} req/s  p50 {fmt(r.percentile(50))} ms  "
            f"p99 {fmt(r.percentile(99))} ms  errors {r.errors}  loadgen CPU {r.gen_cpu_pct:.1f}%")
    return points


def run_user_path(work: Path, routes: list[str], threads: int | None, model: Any, texts: list[str],
                  raw_start: dict[str, Any], ref: np.ndarray, concurrencies: list[int], point_s: float,
                  warmup_s: float, raw_s: float, profile_dir: Path | None, precisions: list[str | None] | None = None,
                  rounds: int = 1) -> dict[str, dict[str, Any]]:
    """The user's path: one cluster per precision (None: the fleet's own `auto`), all running at once so their
    points alternate (an idle cluster costs next to nothing)."""
    say("raw encode before the user's path…")
    adjacent = measure_raw(model, texts, sorted({1, raw_start["best_batch"]}), raw_s)
    clusters: list[Any] = []
    entries: dict[str, dict[str, Any]] = {}
    pairs: list[tuple[Contender, Any]] = []
    try:
        for precision in precisions or [None]:
            label = f" at precision {precision}" if precision else ""
            say(f"user path ({', '.join(routes)}){label}: starting a cluster as `lorafleet up` does…")
            try:
                contenders, cluster = start_user_path(work, routes, threads, precision)
            except Exception as exc:
                say(f"user path{label}: could not start: {exc}")
                entries.update({(f"{r}@{precision}" if precision else r): {"error": f"could not start: {exc}"}
                                for r in routes})
                continue
            clusters.append(cluster)
            for c in contenders:
                cos = check_embeddings(c, texts[:8], ref)
                entries[c.name] = {"startup_s": round(c.started_s, 1), "min_cosine": round(cos, 6),
                                   "endpoint": c.path, "raw_adjacent": adjacent,
                                   "threads": cluster.threads.describe(), "precision": precision or "auto"}
                # What `auto` resolved to is what the worker's heartbeat says; the vectors' agreement is the guard's.
                if cos <= COSINE_MIN:
                    entries[c.name]["error"] = f"embeddings differ from raw encode (min cosine {cos:.5f})"
                else:
                    pairs.append((c, cluster))
            say(f"  ready in {contenders[0].started_s:.1f}s; {cluster.threads.describe()}")
        for name, pts in measure_user_path(pairs, texts, concurrencies, point_s, warmup_s, profile_dir,
                                           rounds).items():
            entries[name]["points"] = pts
        return entries
    except Exception as exc:
        say(f"user path: failed: {exc}")
        return {**entries, **{c.name: {"error": str(exc)} for c, _ in pairs}}
    finally:
        for cluster in clusters:
            cluster.stop()


# -- main ---------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("serve", __doc__)
    p.add_argument("--quick", action="store_true", help="Short points at c=1 and 8 (~1 min).")
    p.add_argument("--contenders", default=None,
                   help=f"Comma-separated subset of {','.join(ALL_CONTENDERS)} "
                        f"(default: the user's path, {','.join(USER_ROUTES)}).")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="Write py-spy flame graphs of the gateway and the worker during the highest concurrency of "
                        "each user-path route to DIR (needs py-spy).")
    p.add_argument("--concurrency", type=int, action="append", default=None,
                   help="Closed-loop concurrency (repeatable; default 1, 8, 32, 128).")
    p.add_argument("--point-s", type=float, default=None, help="Seconds per load point (default 8; quick 1.5).")
    p.add_argument("--batch-sizes", default=None, help="Raw encode batch sizes (default 1,4,8,16,32,64,128).")
    p.add_argument("--max-batch-items", type=int, default=None, help="lorafleet worker profile: max batch items.")
    p.add_argument("--max-wait-ms", type=float, default=None, help="lorafleet worker profile: max wait ms.")
    p.add_argument("--batches-in-flight", type=int, default=None, help="lorafleet worker profile: batches in flight.")
    p.add_argument("--precision", default=None,
                   help="Comma-separated precisions (fp32, bf16, fp16, int8, auto) to serve the lorafleet contenders' "
                        "base at, each measured in turn (`lorafleet@bf16`); default: the base's auto. For the user's "
                        "path, one cluster per precision, all measured in alternation (`openai-base64@fp32`; auto is "
                        "plain `openai-base64`), and `auto:old` / `fp32:old` add the worker's batching as it was "
                        "before issue 27 (one batch per pull, one forward pass per batch); `:passive` sets "
                        "OMP_WAIT_POLICY=PASSIVE in the cluster (OpenMP threads sleep at barriers, not spin); "
                        "`:ahead` serves with batches_in_flight 1 (a batch pulled while another computes); "
                        "`:w1`, `:w2` start that many workers instead of `lorafleet up`'s default.")
    p.add_argument("--rounds", type=int, default=1,
                   help="User path: measure each concurrency this many times, the routes and precisions taking turns "
                        "(the median round is reported).")
    p.add_argument("--ceiling-batch-sizes", default=None,
                   help="Batch sizes of the sorted ceiling (encode over all sentences; default 8,16,32,64).")
    p.add_argument("--infinity-batch-size", type=int, default=32)
    p.add_argument("--infinity-dtype", default=None,
                   help="Comma-separated infinity-emb --dtype values, each measured in turn (`infinity@bfloat16`); "
                        "default: its own (auto).")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for raw encode and every contender (default: torch's own for raw "
                        "encode, the `lorafleet up` plan for the user's path, the number of CPUs for the others).")
    p.add_argument("--device", default="cpu",
                   help="Where raw encode and the lorafleet contenders run (cpu, cuda, cuda:0); the user's path and "
                        "the peers start as they start themselves (scripts/gpu-check.sh uses cuda).")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "serve.json")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    quick = args.quick
    contenders = args.contenders.split(",") if args.contenders else list(USER_ROUTES)
    unknown = [c for c in contenders if c not in ALL_CONTENDERS]
    seen: dict[str, int] = {}
    keys = []  # a contender named twice is measured twice: name, name#2, …
    for c in contenders:
        seen[c] = seen.get(c, 0) + 1
        keys.append(c if seen[c] == 1 else f"{c}#{seen[c]}")
    if unknown:
        print(f"error: unknown contender(s) {unknown}; choose from {ALL_CONTENDERS}", file=sys.stderr)
        return 2
    precisions = args.precision.split(",") if args.precision else [None]
    bad = [p for p in precisions if (p or "auto").partition(":")[0] not in ("auto", "fp32", "bf16", "fp16", "int8")]
    if bad:
        print(f"error: unknown precision(s) {bad}; choose from auto, fp32, bf16, fp16, int8", file=sys.stderr)
        return 2
    # infinity once per --infinity-dtype (`infinity@bfloat16`), adjacent like the precisions below.
    infinity_dtypes = args.infinity_dtype.split(",") if args.infinity_dtype else [None]
    # Each lorafleet contender once per precision, adjacent (fp32 then bf16 …), so drift hits them alike.
    runs = [(f"{k}@{p}" if p else k, n, p) for k, n in zip(keys, contenders, strict=True)
            for p in ([q for q in precisions if ":" not in (q or "")] if n in SECURITY else
                      infinity_dtypes if n == "infinity" else [None])]
    concurrencies = sorted(set(args.concurrency or ([1, 8] if quick else [1, 8, 32, 128])))
    point_s = args.point_s or (1.5 if quick else 8.0)
    warmup_s = 0.5 if quick else 2.0
    raw_s = 1.0 if quick else 3.0
    batch_sizes = ([int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else
                   ([1, 8] if quick else [1, 4, 8, 16, 32, 64, 128]))
    if 1 not in batch_sizes:
        batch_sizes = [1, *batch_sizes]
    profile = {k: v for k, v in {"max_batch_items": args.max_batch_items, "max_wait_ms": args.max_wait_ms,
                                 "batches_in_flight": args.batches_in_flight}.items() if v is not None}
    t_start = time.monotonic()
    info = machine_info()
    say(f"bench/serve: {info['cpus']} CPUs ({info['cpu']}), load average {info['loadavg_start']}; "
        f"contenders {contenders}; concurrency {concurrencies}; {point_s:g}s per point")

    import torch
    from sentence_transformers import SentenceTransformer

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = args.threads or os.cpu_count() or 1  # for the contenders other than the user's path

    from lorafleet.core.model_source import resolve_model_source

    model_dir = resolve_model_source(MODEL_NAME)
    texts = german_sentences(400, seed=args.seed)
    check_texts = texts[:8]
    say("raw in-process encode…")
    model = SentenceTransformer(model_dir, device=args.device)
    raw_start = measure_raw(model, texts, batch_sizes, raw_s)
    ceil_sizes = ([int(b) for b in args.ceiling_batch_sizes.split(",")] if args.ceiling_batch_sizes else
                  ([16, 32] if quick else [8, 16, 32, 64]))
    ceil_texts = texts[:96] if quick else texts
    say("sorted ceiling (encode over all sentences, fp32 and bf16 where native)…")
    ceil_precisions = (["fp32", "fp16", "bf16"] if args.device.startswith("cuda") else
                       ["fp32", *(["bf16"] if "bf16" in _native_reduced() else [])])
    ceiling_start = {p: measure_ceiling(model, ceil_texts, ceil_sizes, raw_s, p) for p in ceil_precisions}
    ref = model.encode(check_texts, show_progress_bar=False)
    lens = [len(t) for t in model.tokenizer(texts)["input_ids"]]

    from lorafleet.core.config import ServingProfile

    systems: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-serve-") as tmp:
        work = Path(tmp)
        user = [(k, n) for k, n, _ in runs if n in USER_ROUTES]
        if user:
            # `--precision fp32,auto`: the user's path once per precision (auto: the fleet file as it is).
            # `auto:old` / `fp32:old`: the same with the worker's pre-issue-27 batching, for a before/after in one run.
            user_precisions = [None if p in (None, "auto") else p for p in precisions]
            systems.update(run_user_path(work, [n for _, n in user], args.threads, model, texts, raw_start, ref,
                                         concurrencies, point_s, warmup_s, raw_s, args.profile,
                                         user_precisions, args.rounds))
        for key, name, precision in runs:
            if name in USER_ROUTES:
                continue
            # Raw encode again right before each system: the ratios use it, since a shared machine drifts.
            say(f"raw encode before {key}…")
            adjacent = measure_raw(model, texts, sorted({1, raw_start["best_batch"]}), raw_s)
            say(f"{key}: starting…")
            try:
                if name in SECURITY:
                    c = start_lorafleet(work, profile, threads, name, precision or "auto", args.device)
                elif name == "naive":
                    c = start_naive(work, model_dir, threads)
                else:
                    c = start_infinity(work, model_dir, args.infinity_batch_size, threads, precision)
            except Exception as exc:  # a contender that cannot run is reported, not fatal
                say(f"{key}: could not start: {exc}")
                systems[key] = {"error": f"could not start: {exc}"}
                continue
            try:
                cos = check_embeddings(c, check_texts, ref)
                say(f"  {key}: ready in {c.started_s:.1f}s; min cosine to raw encode {cos:.6f}")
                entry: dict[str, Any] = {"startup_s": round(c.started_s, 1), "min_cosine": round(cos, 6),
                                         "endpoint": c.path, "raw_adjacent": adjacent}
                if name in SECURITY:
                    entry["profile"] = ServingProfile(**profile).model_dump()
                    entry["nats"] = SECURITY[name]
                    entry["precision"] = precision or "auto"
                if name == "infinity":
                    entry["batch_size"] = args.infinity_batch_size
                    entry["dtype"] = precision or "its default"
                if cos <= COSINE_MIN:
                    entry["error"] = f"embeddings differ from raw encode (min cosine {cos:.5f} ≤ {COSINE_MIN})"
                    say(f"  {name}: {entry['error']}; not timed")
                else:
                    entry["points"] = measure_contender(c, texts, concurrencies, point_s, warmup_s)
                systems[key] = entry
            except Exception as exc:
                say(f"{key}: failed: {exc}")
                systems[key] = {"error": str(exc)}
            finally:
                c.stop()
    say("raw in-process encode again (drift check)…")
    raw_end = measure_raw(model, texts, [raw_start["best_batch"]], raw_s)
    ceiling_end = {p: measure_ceiling(model, ceil_texts, [c["best_batch"]], raw_s, p) for p, c in ceiling_start.items()}
    result: dict[str, Any] = {
        **run_head("serve", quick, info),
        "device": args.device,
        "model": MODEL_NAME, "torch_threads": torch.get_num_threads(),
        "threads_note": ("raw encode at torch's default threads; the user's path as `lorafleet up` plans them"
                         if not args.threads else f"{args.threads} for raw encode and every contender"),
        "inputs": {"description": "German statute sentences, 5–20 words, one per request", "count": len(texts),
                   "mean_tokens": round(float(np.mean(lens)), 1), "max_tokens": int(max(lens))},
        "load": {"kind": "closed loop", "concurrency": concurrencies, "point_s": point_s, "warmup_s": warmup_s,
                 "generator": "lorafleet.tune.loadgen (raw asyncio HTTP/1.1 keep-alive, uvloop)"},
        "raw": {"start": raw_start, "end": raw_end},
        # The ceiling ratios use the mean of start and end (the user's path runs between them).
        "ceiling": {"start": ceiling_start, "end": ceiling_end,
                    "description": "encode(all sentences, batch_size=b): sorted by length, best batch"},
        "systems": systems,
    }
    result["summary"] = summarise(raw_start, {k: v for k, v in systems.items() if "points" in v},
                                  ceiling={p: round((c["best_sentences_per_s"] + ceiling_end[p]["best_sentences_per_s"])
                                                    / 2, 1) for p, c in ceiling_start.items()},
                                  ceiling_per_cpu_s={p: c["best_per_cpu_s"] for p, c in ceiling_start.items()
                                                     if c.get("best_per_cpu_s")})
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    return finish(args.out, result, print_table)


if __name__ == "__main__":
    sys.exit(main())
