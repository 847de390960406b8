"""Many adapters, one base (issue 16): mixed-adapter batches against one adapter per batch and the bare base.

All-MiniLM-L6-v2 with N random LoRA adapters (r=8 on query and value, built once into a cache folder,
bench/adapters_build.py), uniform and Zipf traffic over them, open loop at rising rates (the same
absolute ladder for every contender), one and two workers, three modes side by side in one run:

- mixed: worker profile `mixed_adapter_batches: true` (one forward pass over tasks of many adapters);
- today: `mixed_adapter_batches: false` (one adapter per batch, switched between batches);
- before: one adapter per batch on the runtime as it was before mixed batches (bench/adapters_before.py:
  peft's set_adapter switches and load path, whose cost grows with the adapters loaded);
- ceiling: the bare base, no adapters at all.

Per cell: the highest rate whose p99 stays within the SLO, and saturation throughput (completions over
an overload point and its drain). Adapters are warm (every worker's heartbeat lists them) before a cell
is measured. Then the scale phase (bench/adapters_scale.py): 1,000 adapters against a small adapter
cache, worker RSS throughout, a cold adapter's first request against a warm one.

    python -m lorafleet.bench.adapters [--quick] [--slo-ms 250] [--ns 1,8,64,512] [--no-scale]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lorafleet.bench import adapters_build as build
from lorafleet.bench.adapters_load import Bench, fleet_for
from lorafleet.bench.adapters_report import FEATURES, print_summary, summarise
from lorafleet.bench.adapters_scale import run_scale
from lorafleet.bench.common import RESULTS_DIR, finish, german_sentences, machine_info, parser, run_head, say
from lorafleet.bench.processes import exit_on_sigterm
from lorafleet.core.config import MIB, PACKAGED_MINILM, QueueConfig, ServingProfile

MODES = ("ceiling", "before", "today", "mixed")
MODE_PROFILE: dict[str, dict[str, Any]] = {"ceiling": {}, "before": {"mixed_adapter_batches": False},
                                           "today": {"mixed_adapter_batches": False},
                                           "mixed": {"mixed_adapter_batches": True}}
MODE_RUNTIME = {"before": "sentence-transformers-before"}  # the others: the base's default runtime
FULL_FRACTIONS = [0.2, 0.4, 0.6, 0.75, 0.9, 1.05]
QUICK_FRACTIONS = [0.25, 0.5, 0.8]
_T0 = [time.monotonic()]


def _elapsed() -> str:
    return f"{time.monotonic() - _T0[0]:.0f}s"


def grid(ns: list[int], modes: list[str], two_worker_ns: list[int], today_ns: list[int]
         ) -> list[tuple[str, int, int, str]]:
    """(mode, workers, N, traffic), ordered so that each (mode, workers) needs one worker start and warms ascending N.

    N=1 has one traffic (uniform = Zipf); the ceiling has no adapters (N=0). Two workers only for
    `two_worker_ns` and the ceiling: the column shows scaling, not the whole grid again. Today's mode
    only for `today_ns`: warming 512 adapters costs minutes (peft's load time grows with the adapters
    already loaded), and today at 512 adds little to what it shows at 64.
    """
    out: list[tuple[str, int, int, str]] = []
    for mode in modes:
        for workers in (1, 2):
            if mode == "ceiling":
                if workers == 1 or two_worker_ns:
                    out.append((mode, workers, 0, "none"))
                continue
            for n in sorted(n for n in (ns if workers == 1 else two_worker_ns)
                            if mode not in ("today", "before") or n in today_ns):
                one_traffic = n == 1 or workers == 2  # two workers: uniform only (scaling, not skew)
                out += [(mode, workers, n, t) for t in (("uniform",) if one_traffic else ("uniform", "zipf"))]
    return out


def measure_capacity(model_source: str, texts: list[str], threads: int, seconds: float, device: str) -> float:
    """Sentences/s of one worker's best case: raw in-process encode at batch 16 with the workers' thread count.

    The ladder's rates are fractions of it, so that it reaches saturation on fast and slow machines alike.
    """
    import torch
    from sentence_transformers import SentenceTransformer

    from lorafleet.bench.serve import measure_raw
    from lorafleet.core.model_source import resolve_model_source

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = SentenceTransformer(resolve_model_source(model_source), device=device)
        return float(measure_raw(model, texts, [16], seconds)["best_sentences_per_s"])
    finally:
        torch.set_num_threads(before)


async def run_all(bench: Bench, args: argparse.Namespace, cells: list[tuple[str, int, int, str]], rates: list[float],
                  overload: float, point_s: float, base_profile: dict[str, Any], features: set[str],
                  queue: QueueConfig, model_source: str) -> dict[str, Any]:
    await bench.connect()
    results: dict[str, Any] = {}
    setups: dict[str, Any] = {}
    try:
        current: tuple[str, int] | None = None
        failed: dict[tuple[str, int], str] = {}
        for mode, workers, n, traffic in cells:
            key = f"{mode}/w{workers}/n{n}/{traffic}"
            missing = [f for f in MODE_PROFILE[mode] if f not in features]
            if missing:
                results[key] = {"error": f"ServingProfile has no {', '.join(missing)} yet (not implemented)"}
                continue
            if (mode, workers) in failed:
                results[key] = {"error": failed[(mode, workers)]}
                continue
            profile = {**base_profile, **MODE_PROFILE[mode]}
            try:
                if current != (mode, workers):
                    fleet = fleet_for(model_source, profile, args.adapter_cache, queue, device=args.device,
                                      runtime=MODE_RUNTIME.get(mode))
                    say(f"  [{_elapsed()}] {mode}, {workers} worker(s): starting with profile {profile}…")
                    started = await bench.set_workers(fleet, workers)
                    setups[f"{mode}/w{workers}"] = {"profile": profile, "worker_start_s": round(started, 1),
                                                    "warm": []}
                    current = (mode, workers)
                warm = await bench.warm(n) if n else None
                if warm:
                    setups[f"{mode}/w{workers}"]["warm"].append(warm)
                    say(f"    [{_elapsed()}] warm {n} adapters on {workers} worker(s): {warm['seconds']}s, "
                        f"{warm['requests']} requests, not hot {warm['not_hot']}")
                lad = await bench.ladder(n, traffic, [r * workers for r in rates], overload * workers, point_s,
                                         args.slo_ms, args.seed, args.zipf_s, key)
                results[key] = {"mode": mode, "workers": workers, "adapters": n, "traffic": traffic,
                                "warm": warm, **lad}
            except Exception as exc:  # one cell that cannot run is reported, the others still run
                say(f"  {key}: failed: {exc}")
                results[key] = {"error": str(exc)}
                failed[(mode, workers)] = f"{mode} with {workers} worker(s) failed earlier: {exc}"
                current = None
        scale = await _scale(bench, args, base_profile, features, queue, model_source) if args.scale_adapters else None
    finally:
        await bench.close()
    return {"cells": results, "setups": setups, "scale": scale}


async def _scale(bench: Bench, args: argparse.Namespace, base_profile: dict[str, Any], features: set[str],
                 queue: QueueConfig, model_source: str) -> dict[str, Any]:
    one = build.adapter_bytes(bench.adapters[0])
    floor = MIB  # the least adapter_device_bytes a profile accepts
    device_bytes = max(args.scale_hot * one, floor)
    tiers = {"adapter_device_bytes": device_bytes, "adapter_host_bytes": 2 * args.scale_hot * one,
             "max_batch_adapters": args.scale_hot, "mixed_adapter_batches": True}
    profile = {**base_profile, **{k: v for k, v in tiers.items() if k in features}}
    # Without byte-sized tiers, or adapters so small that the least device budget holds more than scale_hot of
    # them (a tiny test model), today's count bound keeps the hot tier at scale_hot adapters.
    by_bytes = "adapter_device_bytes" in features and device_bytes == args.scale_hot * one
    max_adapters = 1024 if by_bytes else args.scale_hot
    note = None if by_bytes else f"hot tier bounded by worker.max_adapters={max_adapters} (count), not bytes"
    say(f"  [{_elapsed()}] scale: {args.scale_adapters} adapters, profile {profile}, max_adapters {max_adapters}…")
    try:
        await bench.set_workers(fleet_for(model_source, profile, args.adapter_cache, queue, max_adapters,
                                          args.device), 1)
        out = await run_scale(bench, args.scale_adapters, args.scale_cold, args.scale_s, args.scale_concurrency,
                              args.seed, one, args.scale_hot)
    except Exception as exc:
        say(f"  scale: failed: {exc}")
        return {"error": str(exc), "profile": profile}
    return {"profile": profile, "max_adapters": max_adapters, "note": note, **out}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("adapters", __doc__)
    p.add_argument("--quick", action="store_true", help="N=1 and 64, three rates, 1.5 s points, 100 adapters in the "
                   "scale phase, no second worker (under 4 minutes).")
    p.add_argument("--slo-ms", type=float, default=250.0, help="p99 objective of every cell (default 250 ms).")
    p.add_argument("--max-batch-ms", type=float, default=None,
                   help="Workers' batch time budget (default 0.4 × the SLO, as routing does; 0: none).")
    p.add_argument("--ns", default=None, help="Adapter counts, comma-separated (default 1,8,64,512; quick 1,64).")
    p.add_argument("--two-worker-ns", default=None, help="Adapter counts measured with two workers too (default 64; "
                   "quick none; 'none' for none).")
    p.add_argument("--today-ns", default=None, help="Adapter counts measured in today's mode (default: --ns without "
                   "512; see grid()).")
    p.add_argument("--modes", default=",".join(MODES), help=f"Comma-separated subset of {','.join(MODES)}.")
    p.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent of the skewed traffic.")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1: two cores).")
    p.add_argument("--device", default="cpu", help="Workers' device (default cpu; cuda on a GPU host).")
    p.add_argument("--capacity", type=float, default=None, help="req/s of one worker that the rate ladder is "
                   "scaled to (default: measured, raw encode at batch 16).")
    p.add_argument("--point-s", type=float, default=None, help="Seconds of arrivals per rate (default 3; quick 1.5).")
    p.add_argument("--model", default=PACKAGED_MINILM, help="Base model (default the packaged all-MiniLM-L6-v2).")
    p.add_argument("--adapter-cache", type=Path, default=None, help="Folder of the built adapters (default "
                   "LORAFLEET_HOME/bench/adapters/<model>-r8).")
    p.add_argument("--scale-adapters", type=int, default=None, help="Adapters of the scale phase (default 1000; "
                   "quick 100; 0 skips it).")
    p.add_argument("--scale-hot", type=int, default=24, help="Adapters that fit the scale phase's hot tier "
                   "(adapter_device_bytes); the warm tier holds twice as many.")
    p.add_argument("--scale-s", type=float, default=None, help="Seconds of the scale walk (default 45; quick 10).")
    p.add_argument("--scale-cold", type=int, default=None, help="Cold adapters timed (default 20; quick 5).")
    p.add_argument("--scale-concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "adapters.json")
    return p.parse_args(argv)


def _ints(text: str | None, default: list[int]) -> list[int]:
    if text is None:
        return default
    return [] if text == "none" else [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    q = args.quick
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        print(f"error: unknown mode(s) {unknown}; choose from {MODES}", file=sys.stderr)
        return 2
    ns = _ints(args.ns, [1, 64] if q else [1, 8, 64, 512])
    two = [n for n in _ints(args.two_worker_ns, [] if q else [64]) if n in ns]
    today = _ints(args.today_ns, [n for n in ns if n < 512])
    if not ns or min(ns) < 1:
        print("error: --ns needs adapter counts of 1 or more", file=sys.stderr)
        return 2
    point_s = args.point_s or (1.5 if q else 3.0)
    fractions = QUICK_FRACTIONS if q else FULL_FRACTIONS
    args.scale_adapters = (100 if q else 1000) if args.scale_adapters is None else args.scale_adapters
    args.scale_s = args.scale_s or (10.0 if q else 45.0)
    args.scale_cold = args.scale_cold or (5 if q else 20)
    args.adapter_cache = (args.adapter_cache or build.default_cache_dir(args.model)).resolve()
    features = {f for f in FEATURES if f in ServingProfile.model_fields}
    budget = 0.4 * args.slo_ms if args.max_batch_ms is None else (args.max_batch_ms or None)
    base_profile: dict[str, Any] = {"max_batch_ms": budget} if budget else {}
    t0 = _T0[0] = time.monotonic()
    info = machine_info()
    say(f"bench/adapters: N {ns}, modes {modes}, 2 workers for N {two}; SLO p99 {args.slo_ms:g} ms; "
        f"profile fields present: {sorted(features) or 'none'}; load average {info['loadavg_start']}")

    from lorafleet.core.model_source import resolve_model_source
    from lorafleet.nats.server import free_port
    from lorafleet.ops.cluster import LocalCluster

    source = str(resolve_model_source(args.model))
    tb = time.monotonic()
    paths = build.build_adapters(source, args.adapter_cache, max(max(ns), args.scale_adapters))
    built_s = time.monotonic() - tb
    texts = german_sentences(400, seed=args.seed)
    capacity = args.capacity or measure_capacity(source, texts, args.threads, 1.0 if q else 3.0, args.device)
    rates = [round(f * capacity, 1) for f in fractions]
    overload = round(1.4 * capacity, 1)
    say(f"  {len(paths)} adapters ready in {built_s:.1f}s under {args.adapter_cache}; one worker's capacity "
        f"{capacity:.0f} req/s → rates {rates} (× workers), overload {overload}")
    queue = QueueConfig(storage="memory")
    cells = grid(ns, modes, two, today)
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-adapters-") as tmp:
        fleet = fleet_for(source, base_profile, args.adapter_cache, queue, device=args.device)
        cluster = LocalCluster(fleet, workers=1, port=0, home=Path(tmp), nats_port=free_port(),
                               worker_threads=args.threads)
        cluster.start(timeout=240)
        try:
            bench = Bench(cluster, texts, paths)
            run = asyncio.run(run_all(bench, args, cells, rates, overload, point_s, base_profile, features, queue,
                                      source))
            threads = cluster.threads.describe()
        finally:
            cluster.stop()
    result: dict[str, Any] = {
        **run_head("adapters", q, info),
        "setup": {"model": args.model, "adapters": build.describe(paths[0]), "adapter_cache": args.adapter_cache,
                  "adapters_built_s": round(built_s, 1), "slo_p99_ms": args.slo_ms, "base_profile": base_profile,
                  "profile_fields_present": sorted(features), "torch_threads_per_worker": args.threads,
                  "thread_plan": threads, "capacity_one_worker_rps": round(capacity, 1),
                  "rates_one_worker": rates, "overload_one_worker": overload, "point_s": point_s,
                  "zipf_s": args.zipf_s, "ns": ns, "two_worker_ns": two, "today_ns": today,
                  "device": args.device, "queue_storage": queue.storage,
                  "load_generator": "lorafleet.tune.loadgen.open_loop_calls, Poisson, driver plays the gateway "
                                    "(bench/routing.py Driver), latency from the intended send time"},
        **run,
    }
    result["summary"] = summarise(result)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return finish(args.out, result, print_summary)


if __name__ == "__main__":
    sys.exit(main())
