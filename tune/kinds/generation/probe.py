"""The generation kind's probe: a private cluster whose worker runs a vLLM engine, measured by streaming load.

Every profile restarts only the worker (a new engine: ~30 s on a CPU). Each is measured with streaming requests
to the adapters (greedy, `max_tokens` each), closed loop at each concurrency: output tokens/s (the best), time to
first token p50/p99 and inter-token latency at the highest concurrency, peak memory of the worker with its engine.
The load spreads round-robin over the specialist's adapter and `adapters - 1` copies of it under other ids, so the
engine really juggles several LoRAs (copies cost the engine what distinct adapters do: it cannot tell them apart).
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from lorafleet.core.config import BaseModelSpec, FleetConfig, GatewayConfig, ServedModel, WorkerConfig
from lorafleet.models.precision import FP32
from lorafleet.ops.cluster import LocalCluster
from lorafleet.tune.config import GenerativeTuneConfig, TuneError
from lorafleet.tune.generation_guard import Messages
from lorafleet.tune.kind import Say
from lorafleet.tune.kinds.generation.result import GenerativeResult, Options, served_adapters
from lorafleet.tune.probe import PeakMemory, load_texts, start_cluster
from lorafleet.tune.source import TuneSource
from lorafleet.tune.streamload import StreamResult, stream_closed_loop


class GenerativeSweeper:
    def __init__(self, source: TuneSource, cfg: GenerativeTuneConfig, work_dir: Path, say: Say) -> None:
        self.source, self.cfg, self.work_dir, self.say = source, cfg, work_dir, say
        self.cluster: LocalCluster | None = None
        self.texts = [f"Write a short heading for this sentence: {t}" for t in load_texts(seed=cfg.seed)]
        try:
            rank = int(json.loads((source.adapter_dir / "adapter_config.json").read_text()).get("r", 16))
        except (OSError, ValueError, TypeError):
            rank = 16
        self.fixed: Options = {"max_model_len": cfg.max_model_len, "max_lora_rank": max(rank, 8)}
        self.names = [name for name, _ in served_adapters(cfg.adapters)]
        self.precision = FP32  # the base's precision in the tuning fleet: the guard's, then the judged one

    def fleet(self, options: Options) -> FleetConfig:
        base = self.source.base_name
        return FleetConfig(
            bases=[BaseModelSpec(name=base, source=self.source.base_source, revision=self.source.base_revision,
                                 runtime="vllm", precision=self.precision, options={**self.fixed, **options})],
            models=[ServedModel(name=name, base=base, adapter=str(self.source.adapter_dir), adapter_id=adapter_id)
                    for name, adapter_id in served_adapters(self.cfg.adapters)],
            gateway=GatewayConfig(port=0, default_deadline_s=300.0, max_deadline_s=600.0, admit_fraction=None),
            worker=WorkerConfig(device=self.cfg.device),
        )

    def start(self, options: Options) -> None:
        self.cluster = start_cluster(self.fleet(options), self.work_dir / "cluster", timeout=600)
        self._wait_serving(300)

    def apply(self, options: Options) -> float:
        assert self.cluster is not None
        t0 = time.monotonic()
        self.cluster.restart_worker("worker-1", self.fleet(options))
        self.cluster.wait_ready(timeout=600)
        self._wait_serving(300)
        return time.monotonic() - t0

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    def _body(self, i: int) -> dict[str, Any]:
        return {"model": self.names[i % len(self.names)],
                "messages": [{"role": "user", "content": self.texts[i % len(self.texts)]}],
                "max_tokens": self.cfg.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}

    def _wait_serving(self, timeout: float) -> None:
        """Until every adapter id of the load has answered once (each is loaded then, before any measurement)."""
        assert self.cluster is not None
        deadline, last = time.monotonic() + timeout, ""
        for i, name in enumerate(self.names):
            body = {**self._body(i), "stream": False, "max_tokens": 2}
            body.pop("stream_options")
            while True:
                try:
                    r = httpx.post(f"{self.cluster.gateway_url}/v1/chat/completions", json=body, timeout=60)
                    if r.status_code == 200:
                        break
                    last = f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as exc:
                    last = str(exc)
                if time.monotonic() > deadline:
                    raise TuneError(f"the tuning worker did not serve adapter {name} within {timeout:.0f}s ({last})")
                time.sleep(0.5)

    def generate(self, prompts: list[Messages], max_tokens: int) -> list[str]:
        """Greedy answers of the specialist's own adapter to `prompts` through the gateway (the served path)."""
        assert self.cluster is not None
        url = f"{self.cluster.gateway_url}/v1/chat/completions"

        def one(messages: Messages) -> str:
            r = httpx.post(url, json={"model": self.names[0], "messages": messages, "max_tokens": max_tokens,
                                      "temperature": 0}, timeout=600)
            if r.status_code != 200:
                raise TuneError(f"the tuning gateway answered HTTP {r.status_code}: {r.text[:300]}")
            return str(r.json()["choices"][0]["message"]["content"])

        with ThreadPoolExecutor(self.cfg.guard_concurrency) as pool:
            return list(pool.map(one, prompts))

    def measure(self, options: Options, phase: str, restart_s: float) -> GenerativeResult:
        assert self.cluster is not None
        host, port = self.cluster.gateway_url.removeprefix("http://").split(":")
        cfg = self.cfg
        top = max(cfg.concurrencies)
        points: list[StreamResult] = []
        with PeakMemory(self.cluster.pid("worker-1")) as mem:
            if cfg.warmup_s:
                asyncio.run(stream_closed_loop(host, int(port), "/v1/chat/completions", self._body, top, cfg.warmup_s))
            for c in cfg.concurrencies:
                points.append(asyncio.run(stream_closed_loop(host, int(port), "/v1/chat/completions", self._body, c,
                                                             cfg.point_s)))
        last = next(p for p in points if p.level == top).summary()
        return GenerativeResult(options=options, phase=phase, tokens_per_s=max(p.tokens_per_s for p in points),
                                ttft_p50_ms=last["ttft_p50_ms"], ttft_p99_ms=last["ttft_p99_ms"],
                                itl_p50_ms=last["itl_p50_ms"], itl_p99_ms=last["itl_p99_ms"],
                                peak_rss_mb=mem.peak_rss / 2**20, errors=sum(p.errors for p in points),
                                restart_s=restart_s, points=[p.summary() for p in points])
