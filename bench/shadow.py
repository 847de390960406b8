"""The champion's p99 with a shadow at 50 % against without one (issue 25, part 5), on the same load, in one run.

A real cluster (nats-server, one gateway, one worker on the transformers runtime, a real MLflow store) serves a tiny
random Llama with two LoRAs registered as versions 1 and 2 of one generative name; v1 is champion. Rounds alternate
(off/on, then on/off, …, so drift in the machine hits both conditions alike): each round runs the same closed loop,
`--threads` client threads each sending `--requests` chat requests one after another (pausing `--think` × the last
latency after each, so the worker has the spare time a shadow needs), with the shadow of v2 at
`--percent` either absent or running (`promote --shadow`, then `--abort` after the round, which also collects the
gateways' figures). Every answer must come from the champion (`model: NAME@1`). Reported: the champion's p50/p99 per
condition over all its rounds, the ratio p99(on)/p99(off), and how many copies were mirrored, compared and shed.

    .venv/bin/python -m lorafleet.bench.shadow --rounds 6 --threads 2 --requests 40

The machine may be shared: the ratio is a measurement to report, not a pass/fail check (the issue's bar: within
10 %). Results go to bench/results/shadow.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from lorafleet.bench.common import RESULTS_DIR, loadavg, machine_info

NAME = "shadowed"
BASE = "tiny-llama"
PROMPTS = ["The quick brown fox", "Workers pull tasks from the queue", "Kündigung der Wohnung", "Ein Satz"]


def build_models(root: Path, max_positions: int = 512) -> dict[str, Path]:
    """The tiny random Llama (special tokens muted: greedy output never stops early) and LoRAs "a", "b" on q/v
    (the generative serving tests build theirs here too)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lorafleet.testing import build_tiny_llama

    base = build_tiny_llama(root / "base", mute_special_tokens=True, max_positions=max_positions)
    paths = {"base": base}
    for seed, name in enumerate(("a", "b"), 1):
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
            task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        model.save_pretrained(root / f"lora-{name}")
        paths[name] = root / f"lora-{name}"
    return paths


def fleet_config(paths: dict[str, Path]) -> Any:
    from lorafleet.core.config import FleetConfig

    return FleetConfig.model_validate({
        "bases": [{"name": BASE, "source": str(paths["base"]), "runtime": "transformers"}],
        "gateway": {"port": 0, "default_deadline_s": 60},
        "worker": {"heartbeat_s": 0.3, "device": "cpu", "adapter_roots": [str(paths["base"].parent)]},
        "queue": {"storage": "memory"},
    })


def register(paths: dict[str, Path], name: str = NAME, max_tokens: int = 8) -> None:
    """v1 (LoRA a) and v2 (LoRA b) of a generative bundle, greedy with `max_tokens`."""
    from lorafleet.registry import store

    details = {"system_prompt": None, "chat_template": None,
               "generation": {"max_tokens": max_tokens, "temperature": 0.0}}
    for adapter in ("a", "b"):
        store.register_bundle(name, paths[adapter], base_source=str(paths["base"]), base_name=BASE,
                              task="generation", kind="causal-lm", runtime="transformers", details=details,
                              metrics={"test_chrf": 40.0, "base_test_chrf": 20.0})


def closed_loop(url: str, name: str, champion: str, threads: int, requests: int, think: float = 0.0
                ) -> tuple[list[float], list[str]]:
    """Each thread sends `requests` chats one after another, pausing `think` × the last latency after each (the
    load: 0 keeps the worker busy all the time); the latencies (s) and any answer not the champion's."""
    import httpx

    latencies: list[float] = []
    wrong: list[str] = []
    lock = threading.Lock()

    pause = threading.Event()  # never set: a pacing wait

    def client(i: int) -> None:
        with httpx.Client(timeout=120) as http:
            for j in range(requests):
                body = {"model": name, "messages": [{"role": "user", "content": PROMPTS[(i + j) % len(PROMPTS)]}]}
                t0 = time.perf_counter()
                r = http.post(f"{url}/v1/chat/completions", json=body)
                dt = time.perf_counter() - t0
                with lock:
                    latencies.append(dt)
                    if r.status_code != 200 or r.json().get("model") != f"{name}@{champion}":
                        wrong.append(f"{r.status_code} {r.text[:200]}")
                if think:
                    pause.wait(think * dt)

    pool = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return latencies, wrong


def quantile(xs: list[float], q: float) -> float:
    import numpy as np

    return float(np.quantile(np.asarray(xs), q)) if xs else float("nan")


def run_rounds(url: str, kw: dict[str, Any], *, rounds: int, threads: int, requests: int, percent: float,
               think: float = 0.0, name: str = NAME, say: Any = print) -> dict[str, Any]:
    """Interleaved rounds without and with the shadow on a running cluster whose champion of `name` is v1."""
    from lorafleet.registry import shadow
    from lorafleet.registry.promote import Preload

    closed_loop(url, name, "1", threads, max(2, requests // 4))  # warm-up: the worker's first batches
    # and the candidate's adapter loaded once (the preload of each start then finds it in the worker's cache)
    shadow.start(name, "2", percent, force=True, preload=Preload(timeout_s=120.0, progress=lambda _: None), **kw)
    closed_loop(url, name, "1", threads, max(2, requests // 4))
    shadow.abort(name, listen_s=0.1, **kw)
    lat: dict[str, list[float]] = {"off": [], "on": []}
    wrong: list[str] = []
    totals: dict[str, float] = {}
    for r in range(rounds):
        for cond in (("off", "on") if r % 2 == 0 else ("on", "off")):
            if cond == "on":
                shadow.start(name, "2", percent, force=True, preload=Preload(timeout_s=120.0, progress=lambda _: None),
                             **kw)
            got, bad = closed_loop(url, name, "1", threads, requests, think)
            lat[cond] += got
            wrong += bad
            if cond == "on":
                out = shadow.abort(name, listen_s=2.5, **kw)
                for k, v in (out.figures.online_metrics() if out.figures else {}).items():
                    if k.startswith("online_shadow_"):
                        totals[k] = totals.get(k, 0.0) + v
            say(f"round {r + 1}/{rounds} shadow {cond}: p99 {1000 * quantile(got, 0.99):.1f} ms over {len(got)}")
    p99 = {c: quantile(v, 0.99) for c, v in lat.items()}
    return {"p99_ms_without_shadow": 1000 * p99["off"], "p99_ms_with_shadow": 1000 * p99["on"],
            "p50_ms_without_shadow": 1000 * quantile(lat["off"], 0.5),
            "p50_ms_with_shadow": 1000 * quantile(lat["on"], 0.5),
            "ratio_p99": p99["on"] / p99["off"] if p99["off"] else float("nan"),
            "requests_per_condition": len(lat["off"]), "not_from_champion": len(wrong), "examples": wrong[:3],
            "shadow": totals}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="rounds per condition, interleaved")
    p.add_argument("--threads", type=int, default=2, help="client threads (closed loop)")
    p.add_argument("--requests", type=int, default=40, help="requests per thread per round")
    p.add_argument("--percent", type=float, default=50.0, help="the shadow's share")
    p.add_argument("--think", type=float, default=3.0, help="pause after each request, in multiples of its "
                   "latency (3: the champion keeps the worker busy about a quarter of the time; 0: all of it)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "shadow.json")
    args = p.parse_args(argv)
    command = "python -m lorafleet.bench.shadow " + shlex.join(argv if argv is not None else sys.argv[1:])
    from lorafleet.core import settings
    from lorafleet.ops.cluster import LocalCluster
    from lorafleet.registry.promote import Preload, promote

    load_before = loadavg()  # the machine may be shared: say how busy it was
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-shadow-") as tmp:
        os.environ.setdefault("LORAFLEET_HOME", str(Path(tmp) / "home"))
        paths = build_models(Path(tmp) / "models")
        register(paths)
        with LocalCluster(fleet_config(paths), workers=1, port=0, home=settings.home()) as c:
            kw = {"nats_url": c.nats_url, "fleet_file": c.fleet_file}
            promote(NAME, "1", force=True, preload=Preload(timeout_s=120.0, progress=lambda _: None), **kw)
            _wait_served(c.gateway_url)
            result = run_rounds(c.gateway_url, kw, rounds=args.rounds, threads=args.threads,
                                requests=args.requests, percent=args.percent, think=args.think)
    result = {"command": command, "client_threads": args.threads, "rounds": args.rounds,
              "requests_per_thread_per_round": args.requests, "shadow_percent": args.percent, "think": args.think,
              "torch_threads": os.environ.get("OMP_NUM_THREADS", "default"), "machine": machine_info(),
              "loadavg_before": load_before, "loadavg_after": loadavg(), **result}
    print(f"command: {command}  (client threads {args.threads}, worker torch threads "
          f"{result['torch_threads']}, {os.cpu_count()} CPUs)")
    print(f"champion p99 without shadow {result['p99_ms_without_shadow']:.1f} ms, with shadow at {args.percent:g} % "
          f"{result['p99_ms_with_shadow']:.1f} ms: ratio {result['ratio_p99']:.3f}; copies {result['shadow']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    return result


def _wait_served(url: str, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                           json={"model": NAME, "messages": [{"role": "user", "content": "x"}]})
            if r.status_code == 200 and r.json()["model"] == f"{NAME}@1":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{NAME}@1 was not served within {timeout_s:g} s")


if __name__ == "__main__":
    main()
