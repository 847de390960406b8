"""Serving against its ceiling and its peers, side by side in one run (issues 2 and 6 §2).

Same packaged all-MiniLM-L6-v2, same inputs (German statute sentences of 5–20 words, one per
request), same load generator (lorafleet.tune.loadgen, closed loop) against:

- raw: in-process `SentenceTransformer.encode` at batch 1 and at its best batch size (the ceiling);
- lorafleet: the local cluster (nats-server + gateway + 1 worker), `POST /v1/encode/{model}`, as `lorafleet up`
  starts it (NATS authentication on); `lorafleet-tls` the same with TLS on every NATS connection, and
  `lorafleet-open` without authentication (`--insecure-no-auth`): what security costs, side by side;
- naive: a uvicorn app that encodes each request alone on arrival (bench/naive_server.py);
- infinity: infinity-emb 0.0.78 in its own venv (bench/infinity.py; installed on first use).

Only one server runs at a time. Each is checked to return the raw model's embeddings
(cosine > 0.999) before it is timed. Raw encode is measured again at the end to show drift.

    python -m lorafleet.bench.serve [--quick] [--contenders lorafleet,naive,infinity] [--point-s 8]
    python -m lorafleet.bench.serve --contenders lorafleet-open,lorafleet-tls,lorafleet-open,lorafleet-tls \
        --concurrency 1 --concurrency 32          # auth+TLS against none, alternated (medians compared)

A contender named twice is measured twice (`name#2`), so two variants can alternate against drift.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
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
    exit_on_sigterm,
    fmt,
    german_sentences,
    loadavg,
    machine_info,
    say,
    spawn,
    stamp,
    stop_all,
    write_json,
)
from lorafleet.tune.loadgen import LoadResult, Target, closed_loop

MODEL_NAME = "all-MiniLM-L6-v2"
COSINE_MIN = 0.999
ALL_CONTENDERS = ("lorafleet", "lorafleet-tls", "lorafleet-open", "naive", "infinity")
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


# -- contenders ---------------------------------------------------------------------------------

@dataclass
class Contender:
    name: str
    host: str
    port: int
    path: str
    content_type: str
    body: Callable[[str], bytes]
    vectors: Callable[[bytes], np.ndarray]
    stop: Callable[[], None]
    started_s: float = 0.0

    def target(self, texts: list[str]) -> Target:
        bodies = [self.body(t) for t in texts]
        return Target(self.host, self.port, self.path, lambda i: bodies[i % len(bodies)], self.content_type)

    def embed(self, texts: list[str]) -> np.ndarray:
        rows = []
        with httpx.Client(timeout=60) as client:
            for t in texts:
                r = client.post(f"http://{self.host}:{self.port}{self.path}", content=self.body(t),
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


def _infinity_vectors(content: bytes) -> np.ndarray:
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


def start_lorafleet(work: Path, profile: dict[str, Any] | None, threads: int, name: str = "lorafleet") -> Contender:
    from lorafleet.cluster import LocalCluster
    from lorafleet.config import FleetConfig, GatewayConfig, ServingProfile, WorkerConfig
    from lorafleet.nats_server import free_port

    prof = ServingProfile(**(profile or {}))
    fleet = FleetConfig(gateway=GatewayConfig(port=0, default_deadline_s=60.0),
                        worker=WorkerConfig(profile=prof, device="cpu"))
    t0 = time.monotonic()
    home = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    cluster = LocalCluster(fleet, workers=1, port=0, home=home, nats_port=free_port(),
                           extra_env=thread_env(threads), **SECURITY[name]).start(timeout=240)
    c = Contender(name, cluster.host, cluster.port, f"/v1/encode/{MODEL_NAME}", "application/msgpack",
                  _msgpack_body, _msgpack_vectors, cluster.stop)
    c.started_s = time.monotonic() - t0
    return c


def start_naive(work: Path, model_dir: str, threads: int) -> Contender:
    from lorafleet.nats_server import free_port

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
                  _stopper(proc))
    c.started_s = time.monotonic() - t0
    return c


def start_infinity(work: Path, model_dir: str, batch_size: int, threads: int) -> Contender:
    from lorafleet.bench.infinity import ensure_venv, server_argv
    from lorafleet.nats_server import free_port

    exe = ensure_venv(say=say)
    port = free_port()
    log = work / "infinity.log"
    t0 = time.monotonic()
    env = {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
           **thread_env(threads)}
    proc = _spawn(server_argv(exe, model_dir, port, batch_size), log, env)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, 180, log)
    except BaseException:
        _stopper(proc)()
        raise
    c = Contender("infinity", "127.0.0.1", port, "/embeddings", "application/json", _infinity_body,
                  _infinity_vectors, _stopper(proc))
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


def measure_contender(c: Contender, texts: list[str], concurrencies: list[int], point_s: float,
                      warmup_s: float) -> list[dict[str, Any]]:
    target = c.target(texts)
    if warmup_s:
        _run(closed_loop(target, max(8, min(concurrencies[-1], 32)), warmup_s))
    points = []
    for conc in concurrencies:
        r = _run(closed_loop(target, conc, point_s))
        s = r.summary()
        s["statuses"] = {str(k): v for k, v in r.statuses.items()}
        points.append(s)
        say(f"  {c.name:<9} c={conc:<4} {r.throughput:7.1f} req/s  p50 {fmt(r.percentile(50))} ms  "
            f"p99 {fmt(r.percentile(99))} ms  errors {r.errors}  loadgen CPU {r.gen_cpu_pct:.1f}%")
    return points


# -- report -------------------------------------------------------------------------------------

def _refs(raw: dict[str, Any], sysres: dict[str, Any]) -> tuple[float, float | None]:
    """Raw best-batch sentences/s and batch-1 call p50 measured right before this system (else at the start)."""
    adj = sysres.get("raw_adjacent")
    if adj:
        return adj["best_sentences_per_s"], adj.get("batch1_p50_ms")
    return raw["best_sentences_per_s"], raw.get("batch1_p50_ms")


def summarise(raw: dict[str, Any], systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios against raw encode measured right before each system (the machine drifts), and the targets."""
    out: dict[str, Any] = {"raw_best_batch": raw["best_batch"], "raw_best_sentences_per_s": raw["best_sentences_per_s"],
                           "raw_batch1_p50_ms": raw.get("batch1_p50_ms")}
    pts_of = {name: {int(p["level"]): p for p in s.get("points", [])} for name, s in systems.items()}
    naive1 = pts_of.get("naive", {}).get(1)
    for name, sysres in systems.items():
        pts = pts_of[name]
        if not pts:
            continue
        best, b1 = _refs(raw, sysres)
        p1 = pts.get(1)
        out[name] = {
            "raw_best_sentences_per_s": best, "raw_batch1_p50_ms": b1,
            "ratio_to_raw_best": {str(c): round(p["throughput_rps"] / best, 3) for c, p in pts.items()},
            "c1_p50_minus_raw_batch1_ms": (round(p1["p50_ms"] - b1, 2) if p1 and p1["p50_ms"] is not None and b1
                                           else None),
            # The naive server is one HTTP hop plus one encode: what a queue adds beyond plain HTTP.
            "c1_p50_minus_naive_c1_ms": (round(p1["p50_ms"] - naive1["p50_ms"], 2)
                                         if p1 and naive1 and name != "naive" else None),
        }
    targets: dict[str, Any] = {}
    security = security_cost(pts_of)
    if security:
        out["security"] = security
        targets["auth_tls_within_3pct_c32_and_0.5ms_c1"] = {
            k: security[k] for k in ("c32_throughput_ratio", "c1_p50_delta_ms")} | {"met": security["met"]}
    lfp = pts_of.get("lorafleet")
    if lfp:
        ratios = out["lorafleet"]["ratio_to_raw_best"]
        high = [c for c in lfp if c >= 32]
        if high:
            worst = min(ratios[str(c)] for c in high)
            targets["cluster_ge_0.8x_raw_best_at_c>=32"] = {"worst_ratio": worst, "met": worst >= 0.8}
        d = out["lorafleet"]["c1_p50_minus_raw_batch1_ms"]
        if d is not None:
            targets["c1_p50_within_3ms_of_raw_batch1"] = {"delta_ms": d, "met": d <= 3.0}
        infp = pts_of.get("infinity")
        if infp:
            per_c = {}
            for conc in sorted(set(lfp) & set(infp)):
                a, b = lfp[conc], infp[conc]
                per_c[str(conc)] = {
                    "throughput_ratio": (round(a["throughput_rps"] / b["throughput_rps"], 3)
                                         if b["throughput_rps"] else None),
                    "p99_lorafleet_ms": a["p99_ms"], "p99_infinity_ms": b["p99_ms"],
                    "met": a["throughput_rps"] >= b["throughput_rps"] and (a["p99_ms"] or 1e9) <= (b["p99_ms"] or 1e9),
                }
            targets["lorafleet_ge_infinity_at_le_p99"] = {"per_concurrency": per_c,
                                                          "met": all(v["met"] for v in per_c.values())}
    out["targets"] = targets
    return out


def _median(xs: list[float]) -> float | None:
    return round(float(np.median(xs)), 2) if xs else None


def security_cost(pts_of: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any] | None:
    """lorafleet-tls (auth + TLS) against lorafleet-open (neither), medians over their runs: throughput at
    c=32 and p50 at c=1. Targets: at most 3 % lower throughput, at most +0.5 ms."""
    def runs(base: str, level: int, key: str) -> list[float]:
        return [pts[level][key] for name, pts in pts_of.items()
                if name.split("#")[0] == base and level in pts and pts[level][key] is not None]

    tls32, open32 = _median(runs("lorafleet-tls", 32, "throughput_rps")), _median(runs("lorafleet-open", 32,
                                                                                        "throughput_rps"))
    tls1, open1 = _median(runs("lorafleet-tls", 1, "p50_ms")), _median(runs("lorafleet-open", 1, "p50_ms"))
    if None in (tls32, open32) and None in (tls1, open1):
        return None
    ratio = round(tls32 / open32, 3) if tls32 and open32 else None
    delta = round(tls1 - open1, 2) if tls1 is not None and open1 is not None else None
    return {"c32_rps": {"tls": tls32, "open": open32}, "c1_p50_ms": {"tls": tls1, "open": open1},
            "c32_throughput_ratio": ratio, "c1_p50_delta_ms": delta,
            "runs": {"tls": len(runs("lorafleet-tls", 32, "throughput_rps") or runs("lorafleet-tls", 1, "p50_ms")),
                     "open": len(runs("lorafleet-open", 32, "throughput_rps") or runs("lorafleet-open", 1, "p50_ms"))},
            "met": (ratio is None or ratio >= 0.97) and (delta is None or delta <= 0.5)}


def print_table(result: dict[str, Any]) -> None:
    raw = result["raw"]
    print(f"\nraw in-process encode ({MODEL_NAME}, {result['inputs']['description']})")
    for b, r in raw["start"]["by_batch"].items():
        print(f"  batch {b:>3}: {r['sentences_per_s']:7.1f} sentences/s   call p50 {r['call_p50_ms']:.1f} ms")
    if raw.get("end"):
        print(f"  again at the end: best batch {raw['end']['best_batch']}: {raw['end']['best_sentences_per_s']:.1f} "
              f"sentences/s (drift check)")
    s = result["summary"]
    print(f"\n{'system':<10} {'c':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'× raw best':>10} {'errors':>6} "
          f"{'loadgen CPU':>11}")
    for name, sysres in result["systems"].items():
        if "points" not in sysres:
            print(f"{name:<10} not measured: {sysres.get('error')}")
            continue
        for p in sysres["points"]:
            ratio = s[name]["ratio_to_raw_best"][str(int(p["level"]))]
            print(f"{name:<10} {int(p['level']):>4} {p['throughput_rps']:>8.1f} {fmt(p['p50_ms']):>8} "
                  f"{fmt(p['p99_ms']):>8} {ratio:>10.2f} {p['errors']:>6} {p['gen_cpu_pct']:>10.1f}%")
    print(f"\n(× raw best: against raw encode measured right before each system)\n"
          f"raw at the start: best batch {s['raw_best_batch']}: {s['raw_best_sentences_per_s']:.1f} sentences/s; "
          f"batch-1 call p50 {fmt(s['raw_batch1_p50_ms'], 2)} ms")
    for name in result["systems"]:
        if name not in s:
            continue
        v = s[name]
        line = (f"{name}: raw before it {v['raw_best_sentences_per_s']:.1f} sentences/s best batch, batch-1 p50 "
                f"{fmt(v['raw_batch1_p50_ms'], 2)} ms")
        if v["c1_p50_minus_raw_batch1_ms"] is not None:
            line += f"; c=1 p50 − raw batch-1 = {v['c1_p50_minus_raw_batch1_ms']:+.2f} ms"
        if v.get("c1_p50_minus_naive_c1_ms") is not None:
            line += f"; c=1 p50 − naive c=1 p50 = {v['c1_p50_minus_naive_c1_ms']:+.2f} ms"
        print(line)
    for tname, t in s["targets"].items():
        print(f"target {tname}: {'MET' if t['met'] else 'MISSED'}  "
              f"{ {k: v for k, v in t.items() if k not in ('met', 'per_concurrency')} or ''}")
        for conc, v in t.get("per_concurrency", {}).items():
            print(f"    c={conc}: lorafleet/infinity throughput {v['throughput_ratio']}, "
                  f"p99 {v['p99_lorafleet_ms']} vs {v['p99_infinity_ms']} ms → {'met' if v['met'] else 'missed'}")


# -- main ---------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lorafleet.bench.serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="Short points, c=1 and 8, lorafleet + naive only (~1 min).")
    p.add_argument("--contenders", default=None,
                   help=f"Comma-separated subset of {','.join(ALL_CONTENDERS)} "
                        "(default: all; --quick: lorafleet,naive).")
    p.add_argument("--concurrency", type=int, action="append", default=None,
                   help="Closed-loop concurrency (repeatable; default 1, 8, 32, 128).")
    p.add_argument("--point-s", type=float, default=None, help="Seconds per load point (default 8; quick 1.5).")
    p.add_argument("--batch-sizes", default=None, help="Raw encode batch sizes (default 1,4,8,16,32,64,128).")
    p.add_argument("--max-batch-items", type=int, default=None, help="lorafleet worker profile: max batch items.")
    p.add_argument("--max-wait-ms", type=float, default=None, help="lorafleet worker profile: max wait ms.")
    p.add_argument("--batches-in-flight", type=int, default=None, help="lorafleet worker profile: batches in flight.")
    p.add_argument("--infinity-batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for every contender (default: the number of CPUs).")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "serve.json")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    quick = args.quick
    contenders = (args.contenders.split(",") if args.contenders else
                  (["lorafleet", "naive"] if quick else list(ALL_CONTENDERS)))
    unknown = [c for c in contenders if c not in ALL_CONTENDERS]
    seen: dict[str, int] = {}
    keys = []  # a contender named twice is measured twice: name, name#2, …
    for c in contenders:
        seen[c] = seen.get(c, 0) + 1
        keys.append(c if seen[c] == 1 else f"{c}#{seen[c]}")
    if unknown:
        print(f"error: unknown contender(s) {unknown}; choose from {ALL_CONTENDERS}", file=sys.stderr)
        return 2
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

    threads = args.threads or os.cpu_count() or 1
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)

    from lorafleet.models import resolve_model_source

    model_dir = resolve_model_source(MODEL_NAME)
    texts = german_sentences(400, seed=args.seed)
    check_texts = texts[:8]
    say("raw in-process encode…")
    model = SentenceTransformer(model_dir, device="cpu")
    raw_start = measure_raw(model, texts, batch_sizes, raw_s)
    ref = model.encode(check_texts, show_progress_bar=False)
    lens = [len(t) for t in model.tokenizer(texts)["input_ids"]]

    from lorafleet.config import ServingProfile

    systems: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-serve-") as tmp:
        work = Path(tmp)
        for key, name in zip(keys, contenders, strict=True):
            # Raw encode again right before each system: the ratios use it, since a shared machine drifts.
            say(f"raw encode before {key}…")
            adjacent = measure_raw(model, texts, sorted({1, raw_start["best_batch"]}), raw_s)
            say(f"{key}: starting…")
            try:
                if name in SECURITY:
                    c = start_lorafleet(work, profile, threads, name)
                elif name == "naive":
                    c = start_naive(work, model_dir, threads)
                else:
                    c = start_infinity(work, model_dir, args.infinity_batch_size, threads)
            except Exception as exc:  # a contender that cannot run is reported, not fatal
                say(f"{key}: could not start: {exc}")
                systems[key] = {"error": f"could not start: {exc}"}
                continue
            try:
                cos = check_embeddings(c, check_texts, ref)
                say(f"  {name}: ready in {c.started_s:.1f}s; min cosine to raw encode {cos:.6f}")
                entry: dict[str, Any] = {"startup_s": round(c.started_s, 1), "min_cosine": round(cos, 6),
                                         "endpoint": c.path, "raw_adjacent": adjacent}
                if name in SECURITY:
                    entry["profile"] = ServingProfile(**profile).model_dump()
                    entry["nats"] = SECURITY[name]
                if name == "infinity":
                    entry["batch_size"] = args.infinity_batch_size
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
    result: dict[str, Any] = {
        "benchmark": "serve", "when": stamp(), "quick": quick, "machine": {**info, "loadavg_end": loadavg()},
        "model": MODEL_NAME, "torch_threads": threads,
        "inputs": {"description": "German statute sentences, 5–20 words, one per request", "count": len(texts),
                   "mean_tokens": round(float(np.mean(lens)), 1), "max_tokens": int(max(lens))},
        "load": {"kind": "closed loop", "concurrency": concurrencies, "point_s": point_s, "warmup_s": warmup_s,
                 "generator": "lorafleet.tune.loadgen (raw asyncio HTTP/1.1 keep-alive, uvloop)"},
        "raw": {"start": raw_start, "end": raw_end},
        "systems": systems,
    }
    result["summary"] = summarise(raw_start, {k: v for k, v in systems.items() if "points" in v})
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    write_json(args.out, result)
    print_table(result)
    print(f"\nwrote {args.out} ({result['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
