"""Calibrate the agent benchmark's model costs from the real models on this machine.

For each packaged model the fleet serves (MiniLM embedder, MiniLM as a cross-encoder, SmolLM2-135M and
Gemma 3 270M generating), in this process with one torch thread (as each worker of `lorafleet up` runs):
the load time from the local cache, the resident memory it adds (RSS delta), and a batch's cost at a
few sizes fitted as a + b·n ms by least squares. It prints the `models:` entries a scenario takes.

    python -m lorafleet.bench.fleet_calibrate [--out FILE] [--tokens 16] [--only minilm,ce,smollm2,gemma]
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorafleet.bench.common import german_sentences, machine_info, say, write_json

SIZES = (1, 4, 8, 16)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _weights_mb(model: Any) -> float:
    net = model[1] if isinstance(model, tuple) else model
    net = getattr(net, "model", net) if not hasattr(net, "parameters") else net
    return sum(p.numel() * p.element_size() for p in net.parameters()) / 2**20


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    b = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return max(my - b * mx, 0.0), max(b, 0.0)


def _time_batches(run: Callable[[int], None], repeats: int) -> list[tuple[int, float]]:
    run(2)  # warm-up: first calls allocate
    out = []
    for n in SIZES:
        best = min(_timed(run, n) for _ in range(repeats))
        out.append((n, best))
    return out


def _timed(run: Callable[[int], None], n: int) -> float:
    t0 = time.perf_counter()
    run(n)
    return (time.perf_counter() - t0) * 1000.0


def _measure(name: str, kind: str, load: Callable[[], Any], batch: Callable[[Any, int], None], repeats: int,
             source: str) -> dict[str, Any]:
    gc.collect()
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    model = load()
    load_ms = (time.perf_counter() - t0) * 1000.0
    points = _time_batches(lambda n, m=model: batch(m, n), repeats)
    # RSS after the batches (weights touched, activations allocated), never below the weights themselves.
    memory = max(_rss_mb() - rss0, _weights_mb(model))
    a, b = _fit(points)
    say(f"  {name:<10} load {load_ms / 1000:.1f}s  +{memory:.0f} MB  a={a:.1f} ms  b={b:.1f} ms  "
        f"({', '.join(f'n={n}: {ms:.0f}' for n, ms in points)} ms)")
    del model
    gc.collect()
    return {"kind": kind, "a_ms": round(a, 1), "b_ms": round(b, 1), "memory_mb": max(int(memory), 1),
            "load_ms": round(load_ms), "calibrated_from": source, "points_ms": [[n, round(ms, 1)] for n, ms in points]}


def calibrate(only: set[str], tokens: int, repeats: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    texts = german_sentences(64, seed=3)
    out: dict[str, Any] = {}
    if "minilm" in only:
        from sentence_transformers import SentenceTransformer

        from lorafleet.core.model_source import resolve_model_source

        src = resolve_model_source("all-MiniLM-L6-v2")
        out["minilm"] = _measure("minilm", "embed", lambda: SentenceTransformer(src, device="cpu"),
                                 lambda m, n: m.encode(texts[:n], batch_size=n), repeats,
                                 "all-MiniLM-L6-v2, fp32, 1 thread, statute sentences")
    if "ce" in only:
        from sentence_transformers import CrossEncoder

        from lorafleet.core.model_source import resolve_model_source

        src = resolve_model_source("all-MiniLM-L6-v2")
        pairs = [(texts[i], texts[(i + 7) % len(texts)]) for i in range(len(texts))]
        out["ce"] = _measure("ce", "rerank", lambda: CrossEncoder(src, num_labels=1, device="cpu"),
                             lambda m, n: m.predict(pairs[:n], batch_size=n), repeats,
                             "all-MiniLM-L6-v2 as a cross-encoder, fp32, 1 thread, query-passage pairs")
    for key, name in (("smollm2", "SmolLM2-135M-Instruct"), ("gemma", "gemma-3-270m")):
        if key not in only:
            continue
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lorafleet.models.causal import resolve_causal_source

        src = resolve_causal_source(name)  # converted once and cached: what a worker's cold start reads

        def load_lm(src: Any = src) -> Any:
            tok = AutoTokenizer.from_pretrained(src)
            tok.padding_side = "left"
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
            return tok, AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()

        def generate(m: Any, n: int) -> None:
            tok, model = m
            enc = tok(texts[:n], return_tensors="pt", padding=True)
            with torch.inference_mode():
                model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)

        out[key] = _measure(key, "generate", load_lm, generate, max(1, repeats - 1),
                            f"{name}, fp32, 1 thread, {tokens} new tokens per request, greedy")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (default: print only)")
    p.add_argument("--tokens", type=int, default=16, help="new tokens per generation request")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per batch size (best kept)")
    p.add_argument("--only", default="minilm,ce,smollm2,gemma", help="comma-separated subset")
    args = p.parse_args(argv)
    say(f"calibrating on {machine_info().get('cpu', '?')}, 1 torch thread")
    models = calibrate(set(args.only.split(",")), args.tokens, args.repeats)
    result = {"machine": machine_info(), "threads": 1, "tokens": args.tokens, "models": models}
    if args.out is not None:
        write_json(args.out, result)
        say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
