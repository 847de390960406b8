"""Reranking (issue 26), three measurements side by side in one run:

- speed: `/v1/rerank` with 1 query × 50 documents at concurrency 8 (a real cluster: nats-server, gateway,
  one cross-encoder worker), pairs/s against raw `CrossEncoder.predict` at its best batch size with the
  worker's thread count, measured in this process before and after the cluster (the better is the
  ceiling, and nothing else of the benchmark runs meanwhile). Target ≥ 0.85× the ceiling. With `--infinity`,
  infinity-emb's `/rerank` on the same model (saved as a sequence classifier with the same seeded head) under
  the same load and thread count, after the cluster.
- mixed adapters: 16 reranker LoRAs (each with its own head) on one base, small requests spread over
  them at concurrency 16; the worker with `mixed_adapter_batches: true` against one adapter per batch.
  Target ≥ 2×.
- quality: on the test split of a rerank config (configs/german-legal-rerank.yaml), the config's pipeline
  (first stage + LoRA reranker, trained here, its wall time reported) against the best first stage
  alone among BM25, dense (the base embedder), RRF hybrid and, with `--specialist models:/NAME/N`, a
  registered embedding specialist. Target ≥ 1.15× nDCG@10, training ≤ 15 min.

    python -m lorafleet.bench.rerank [--quick] [--parts speed,mixed,quality] [--set train.key=value …]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from lorafleet.bench.common import (
    RESULTS_DIR,
    exit_on_sigterm,
    german_sentences,
    loadavg,
    machine_info,
    say,
    stamp,
    write_json,
)
from lorafleet.core.config import PACKAGED_MINILM, FleetConfig

CE_BASE = "reranker"
PARTS = ("speed", "mixed", "quality")


def _run_async(coro: Any) -> Any:
    from lorafleet.tune.probe import run_async

    return run_async(coro)


def _bodies(model: str | list[str], documents: int, n: int, seed: int) -> list[bytes]:
    """JSON bodies of /v1/rerank: statute sentences as documents, a sentence's first words as the query; a list of
    models is cycled through, request i to model i mod len."""
    from lorafleet.tune.kinds.rerank.load import rerank_bodies

    texts = german_sentences(400, seed=seed)
    names = [model] if isinstance(model, str) else model
    out = rerank_bodies(texts, documents, n=n, seed=seed)
    return [json.dumps({**json.loads(b), "model": names[i % len(names)]}).encode() for i, b in enumerate(out)]


def _pairs(bodies: list[bytes]) -> list[list[str]]:
    return [[b["query"], d] for b in map(json.loads, bodies) for d in b["documents"]]


def raw_predict(model: Any, pairs: list[list[str]], batch_sizes: list[int], threads: int) -> dict[str, Any]:
    """pairs/s of CrossEncoder.predict over `pairs` per batch size (after one warm-up call), with `threads`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model.predict(pairs[: max(batch_sizes)], batch_size=max(batch_sizes), show_progress_bar=False)
        rates = {}
        for bs in batch_sizes:
            t0 = time.perf_counter()
            model.predict(pairs, batch_size=bs, show_progress_bar=False)
            rates[bs] = len(pairs) / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    best = max(rates, key=lambda b: rates[b])
    return {"pairs_per_s": {str(b): round(r, 1) for b, r in rates.items()}, "best_batch": best,
            "best_pairs_per_s": round(rates[best], 1), "threads": threads, "loadavg": loadavg()}


def _cluster(cfg: FleetConfig, home: Path, threads: int | None) -> Any:
    from lorafleet.ops.cluster import LocalCluster

    c = LocalCluster(cfg, workers=1, port=0, home=home, worker_threads=threads)
    c.start(timeout=300)
    return c


def _closed(url: str, bodies: list[bytes], concurrency: int, duration_s: float) -> Any:
    from lorafleet.tune.kinds.rerank.load import rerank_target
    from lorafleet.tune.loadgen import closed_loop

    return _run_async(closed_loop(rerank_target(url, bodies), concurrency, duration_s))


def _fleet(model: str, profile: dict[str, Any], served: list[dict[str, Any]] | None = None,
           roots: list[str] | None = None) -> FleetConfig:
    return FleetConfig.model_validate({
        "bases": [{"name": CE_BASE, "source": model, "runtime": "cross-encoder"}],
        "models": served or [],
        "gateway": {"port": 0, "default_deadline_s": 120, "admit_fraction": None},
        "worker": {"device": "cpu", "profile": profile, "adapter_roots": roots or []},
        "queue": {"storage": "memory"},
    })


def run_speed(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from lorafleet.core.model_source import resolve_model_source
    from lorafleet.sidecar.ce_runtime import load_cross_encoder

    bodies = _bodies(CE_BASE, args.docs, 16, seed=1)
    pairs = _pairs(bodies)[: args.raw_pairs]
    model = load_cross_encoder(resolve_model_source(args.model))
    # Served as saved with its seeded head: a bare base whose head is drawn at load is refused (409), and the
    # cost per pair is the same.
    served_model = work / "speed-ce"
    model.save_pretrained(str(served_model))
    profile = {"max_batch_items": args.items, "max_batch_tokens": args.tokens, "max_wait_ms": 2}
    cluster = None
    try:
        cluster = _cluster(_fleet(str(served_model), profile), work / "speed", args.threads)
        threads = cluster.threads.worker
        cluster.stop()
        cluster = None
        say(f"  raw CrossEncoder.predict, {len(pairs)} pairs, {threads} thread(s)…")
        raw = [raw_predict(model, pairs, args.batch_sizes, threads)]
        cluster = _cluster(_fleet(str(served_model), profile), work / "speed2", args.threads)
        _closed(cluster.gateway_url, bodies, args.concurrency, args.warmup_s)
        say(f"  /v1/rerank 1×{args.docs} at concurrency {args.concurrency} for {args.duration_s:g}s…")
        load = _closed(cluster.gateway_url, bodies, args.concurrency, args.duration_s)
        served_load = loadavg()
    finally:
        if cluster is not None:
            cluster.stop()
    raw.append(raw_predict(model, pairs, args.batch_sizes, threads))
    ceiling = max(r["best_pairs_per_s"] for r in raw)
    pairs_s = load.throughput * args.docs
    out = {"documents": args.docs, "concurrency": args.concurrency, "profile": profile, "threads": threads,
           "served": {**load.summary(), "pairs_per_s": round(pairs_s, 1), "loadavg": served_load},
           "raw": raw, "ceiling_pairs_per_s": ceiling, "ratio": round(pairs_s / ceiling, 3) if ceiling else None,
           "target": 0.85}
    if args.infinity:
        try:
            out["infinity"] = run_infinity(args, work, model, bodies, threads)
            out["infinity"]["lorafleet_ratio"] = round(pairs_s / out["infinity"]["pairs_per_s"], 3)
        except Exception as exc:  # infinity is a peer to report, not a part that fails the rest
            out["infinity"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def run_infinity(args: argparse.Namespace, work: Path, model: Any, bodies: list[bytes],
                 threads: int) -> dict[str, Any]:
    """infinity-emb's /rerank on the same cross-encoder (saved with its seeded head, so it loads as a sequence
    classifier and infinity serves it as a reranker), the same bodies, concurrency and duration."""
    from lorafleet.bench.serve import start_infinity
    from lorafleet.tune.loadgen import Target, closed_loop

    model_dir = work / "infinity-ce"
    model.save_pretrained(str(model_dir))
    c = start_infinity(work, str(model_dir), args.infinity_batch_size, threads)
    try:
        served = [json.dumps({**json.loads(b), "model": "all-MiniLM-L6-v2"}).encode() for b in bodies]
        target = Target(c.host, c.port, "/rerank", lambda i: served[i % len(served)], content_type="application/json")
        _run_async(closed_loop(target, args.concurrency, args.warmup_s))
        say(f"  infinity-emb /rerank 1×{args.docs} at concurrency {args.concurrency} for {args.duration_s:g}s…")
        load = _run_async(closed_loop(target, args.concurrency, args.duration_s))
    finally:
        c.stop()
    return {**load.summary(), "pairs_per_s": round(load.throughput * args.docs, 1), "threads": threads,
            "batch_size": args.infinity_batch_size, "started_s": round(c.started_s, 1), "loadavg": loadavg()}


def _adapters(model: str, n: int, out: Path) -> list[Path]:
    """`n` LoRAs of the cross-encoder (r=8 on query/value, each with its own trained-looking head), built once."""
    from lorafleet.core.model_source import resolve_model_source
    from lorafleet.sidecar.ce_runtime import load_cross_encoder
    from lorafleet.testing import add_random_ce_adapter

    paths = [out / f"ce-{i}" for i in range(n)]
    if all((p / "adapter_config.json").is_file() for p in paths):
        return paths
    for i, path in enumerate(paths):
        ce = load_cross_encoder(resolve_model_source(model))
        add_random_ce_adapter(ce, f"ce-{i}", r=8, seed=100 + i, scale=0.05)
        ce.save_pretrained(str(path))
    return paths


def run_mixed(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    paths = _adapters(args.model, args.adapters, args.adapter_cache)
    served = [{"name": p.name, "base": CE_BASE, "adapter": str(p), "adapter_id": p.name} for p in paths]
    names = [p.name for p in paths]
    bodies = _bodies(names, args.mixed_docs, max(4 * len(names), 16), seed=2)
    out: dict[str, Any] = {"adapters": len(paths), "documents": args.mixed_docs,
                           "concurrency": args.mixed_concurrency, "modes": {}}
    for mode, mixed in (("one_adapter_per_batch", False), ("mixed", True)):
        profile = {"max_batch_items": args.items, "max_batch_tokens": args.tokens, "max_wait_ms": 2,
                   "mixed_adapter_batches": mixed}
        cluster = _cluster(_fleet(args.model, profile, served, [str(args.adapter_cache)]), work / mode, args.threads)
        try:
            _closed(cluster.gateway_url, bodies[: len(names)], 1, max(args.warmup_s, 0.1))  # every adapter loaded
            _closed(cluster.gateway_url, bodies, args.mixed_concurrency, args.warmup_s)
            say(f"  {mode}: {len(names)} adapters, 1×{args.mixed_docs} at concurrency {args.mixed_concurrency}…")
            load = _closed(cluster.gateway_url, bodies, args.mixed_concurrency, args.duration_s)
        finally:
            cluster.stop()
        out["modes"][mode] = {**load.summary(), "pairs_per_s": round(load.throughput * args.mixed_docs, 1),
                              "profile": profile, "loadavg": loadavg()}
    one = out["modes"]["one_adapter_per_batch"]["pairs_per_s"]
    out["ratio"] = round(out["modes"]["mixed"]["pairs_per_s"] / one, 3) if one else None
    out["target"] = 2.0
    return out


def _stage_configs(cfg: Any, specialist: str | None) -> dict[str, Any]:
    s = cfg.first_stage
    stages = {"bm25": s.model_copy(update={"kind": "bm25"}), "dense": s.model_copy(update={"kind": "dense"}),
              "hybrid": s.model_copy(update={"kind": "hybrid"})}
    if specialist:
        stages["specialist"] = s.model_copy(update={"kind": "dense", "embedder": specialist})
        stages["specialist+bm25 hybrid"] = s.model_copy(update={"kind": "hybrid", "embedder": specialist})
    return stages


def run_quality(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import yaml

    from lorafleet.core.tasks import get_task_kind
    from lorafleet.models.device import resolve_device
    from lorafleet.train.kinds.rerank.evaluate import pipeline_metrics
    from lorafleet.train.kinds.rerank.trainer import train_reranker

    raw = yaml.safe_load(Path(args.config).read_text())["train"]
    for item in args.set:
        key, _, value = item.partition("=")
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    if args.threads:  # training and evaluation in this process: the same thread count as the served parts
        import torch

        torch.set_num_threads(args.threads)
    kind = get_task_kind("rerank")
    cfg = kind.parse_config(raw)
    device = resolve_device(cfg.device)
    dataset = kind.build_dataset(cfg)
    first: dict[str, float] = {}
    for name, stage in _stage_configs(cfg, args.specialist).items():
        m = pipeline_metrics(None, dataset, stage, "test", device=device, batch_size=cfg.eval_batch_size)
        first[name] = round(m["first_test_ndcg@10"], 4)
        say(f"  first stage {name} alone: test nDCG@10 {first[name]:.4f}")
    t0 = time.monotonic()
    result = train_reranker(cfg, dataset, work / "quality", evaluate_test=True)
    train_s = time.monotonic() - t0
    best_name = max(first, key=lambda k: first[k])
    ndcg = result.metrics["test_ndcg@10"]
    return {"config": args.config, "overrides": args.set, "pipeline": kind.bundle_details(cfg)["pipeline"],
            "dataset": dataset.summary(), "first_stages_test_ndcg@10": first, "best_first_stage": best_name,
            "pipeline_test_ndcg@10": round(ndcg, 4),
            "pipeline_own_first_stage_test_ndcg@10": round(result.metrics["first_test_ndcg@10"], 4),
            "ratio": round(ndcg / first[best_name], 3) if first[best_name] else None, "target": 1.15,
            "train_wall_s": round(train_s, 1), "train_cost": result.cost, "train_target_s": 900,
            "loadavg": loadavg()}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="Tiny sizes: seconds per part (a smoke test).")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "rerank.json")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--model", default=PACKAGED_MINILM, help="The cross-encoder base (a BERT gets a seeded head).")
    p.add_argument("--threads", type=int, default=None, help="Torch threads of the worker and of raw predict and "
                   "training here (default: the worker's share of the CPUs). On a shared 2-vCPU machine use 1: a "
                   "team of 2 stalls whenever another process takes a core (docs/benchmarks.md, Torch threads).")
    p.add_argument("--docs", type=int, default=50)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--raw-pairs", type=int, default=400)
    p.add_argument("--batch-sizes", default="16,32,64,128")
    p.add_argument("--infinity", action="store_true", help="speed: also infinity-emb's /rerank on the same model "
                   "(its own venv, created on first use: a few minutes).")
    p.add_argument("--infinity-batch-size", type=int, default=32)
    p.add_argument("--items", type=int, default=8, help="Worker profile: max_batch_items (tasks per batch).")
    p.add_argument("--tokens", type=int, default=16384, help="Worker profile: max_batch_tokens.")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--mixed-docs", type=int, default=4)
    p.add_argument("--mixed-concurrency", type=int, default=16)
    p.add_argument("--adapter-cache", type=Path, default=None)
    p.add_argument("--config", default="configs/german-legal-rerank.yaml")
    p.add_argument("--set", action="append", default=[], help="Override the config's train: key=value (dotted).")
    p.add_argument("--specialist", default=None, help="A registered embedding specialist models:/NAME/N as one more "
                   "first stage (the one configs/german-legal.yaml trains).")
    args = p.parse_args()
    if args.quick:
        args.duration_s, args.warmup_s, args.raw_pairs, args.batch_sizes = 2.0, 0.5, 64, "16,32"
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    args.parts = [x for x in args.parts.split(",") if x]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    return args


def main() -> None:
    exit_on_sigterm()
    args = _parse()
    out: dict[str, Any] = {"benchmark": "rerank", "quick": args.quick, "started": stamp(), "machine": machine_info(),
                           "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-rerank-") as tmp:
        work = Path(tmp)
        args.adapter_cache = args.adapter_cache or work / "adapters"
        for part, fn in (("speed", run_speed), ("mixed", run_mixed), ("quality", run_quality)):
            if part not in args.parts:
                continue
            say(f"[rerank bench] {part}…  ({time.monotonic() - t0:.0f}s)")
            try:
                out[part] = fn(args, work)
            except Exception as exc:  # one part failing still reports the others
                out[part] = {"error": f"{type(exc).__name__}: {exc}"}
            say(f"[rerank bench] {part}: {json.dumps({k: v for k, v in out[part].items() if k in ('ratio', 'error')})}")
            write_json(args.out, out)
    out["summary"] = {part: {"ratio": out[part].get("ratio"), "target": out[part].get("target")}
                      for part in PARTS if part in out}
    out["loadavg_end"] = loadavg()
    out["wall_s"] = round(time.monotonic() - t0, 1)
    write_json(args.out, out)
    print_table(out)
    print(f"wrote {args.out}")


def print_table(out: dict[str, Any]) -> None:
    """One line per part: the figure, its ceiling or reference, the ratio against the target."""
    rows = []
    if "speed" in out and "error" not in out["speed"]:
        s = out["speed"]
        rows.append((f"speed: /v1/rerank 1×{s['documents']} @ c{s['concurrency']} (pairs/s)",
                     s["served"]["pairs_per_s"], f"raw predict best {s['ceiling_pairs_per_s']}", s["ratio"],
                     s["target"]))
        inf = s.get("infinity")
        if inf and "error" not in inf:
            rows.append(("speed: infinity-emb /rerank, same load (pairs/s)", inf["pairs_per_s"],
                         f"lorafleet {s['served']['pairs_per_s']}", inf["lorafleet_ratio"], None))
    if "mixed" in out and "error" not in out["mixed"]:
        m = out["mixed"]
        rows.append((f"mixed: {m['adapters']} adapters, mixed batches (pairs/s)", m["modes"]["mixed"]["pairs_per_s"],
                     f"one adapter per batch {m['modes']['one_adapter_per_batch']['pairs_per_s']}", m["ratio"],
                     m["target"]))
    if "quality" in out and "error" not in out["quality"]:
        q = out["quality"]
        best = q["best_first_stage"]
        rows.append((f"quality: pipeline test nDCG@10 (trained in {q['train_wall_s']:.0f}s)",
                     q["pipeline_test_ndcg@10"],
                     f"best first stage {best} {q['first_stages_test_ndcg@10'][best]}",
                     q["ratio"], q["target"]))
    for part in PARTS:
        if "error" in out.get(part, {}):
            rows.append((f"{part}: FAILED {out[part]['error'][:80]}", None, "", None, None))
    for name, value, ref, ratio, target in rows:
        print(f"{name:<58} {value!s:>9}  vs {ref:<40} ratio {ratio!s:>6} (target {target})")
    print(f"load average at the end: {out.get('loadavg_end')}; wall {out.get('wall_s')} s")


if __name__ == "__main__":
    main()
