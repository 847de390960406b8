"""The scale phase of the adapter benchmark: many registered adapters, a bounded adapter cache, worker RSS.

One worker whose hot tier (`adapter_device_bytes`) holds only a few dozen adapters and whose warm tier
(`adapter_host_bytes`) a few dozen more serves requests naming any of `n` adapters (1,000 by default,
task URIs under `worker.adapter_roots`). Measured: the latency of a cold adapter's first request (read
from disk and loaded) against the same adapter's next one (hot), an adapter revisited after it was
evicted, and the worker's RSS (psutil, every 0.25 s) while a closed loop walks through every adapter.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import numpy as np
import psutil

from lorafleet.bench.adapters_load import Bench
from lorafleet.bench.common import say

MIB = 2**20


def _stats(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50_ms": None, "p90_ms": None, "max_ms": None}
    return {"n": len(values), "p50_ms": round(float(np.percentile(values, 50)), 1),
            "p90_ms": round(float(np.percentile(values, 90)), 1), "max_ms": round(max(values), 1)}


class RssSampler:
    """RSS of one process every `every_s` seconds, in the background of the event loop."""

    def __init__(self, pid: int, every_s: float = 0.25) -> None:
        self.proc = psutil.Process(pid)
        self.every_s = every_s
        self.samples: list[tuple[float, int]] = []
        self._task: asyncio.Task[None] | None = None
        self._t0 = time.monotonic()

    def sample(self) -> int:
        rss = int(self.proc.memory_info().rss)
        self.samples.append((round(time.monotonic() - self._t0, 2), rss))
        return rss

    async def _loop(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.every_s)

    def start(self) -> RssSampler:
        self._task = asyncio.create_task(self._loop())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sample()


async def run_scale(bench: Bench, n: int, cold_samples: int, churn_s: float, concurrency: int, seed: int,
                    adapter_bytes: int, hot: int) -> dict[str, Any]:
    """Cold against warm latency, then a closed loop walking through all `n` adapters, RSS sampled throughout.

    After the walk: adapters evicted from the device a little earlier (sent between 2×`hot` and `hot`
    requests before its end: within reach of a warm tier twice the hot tier's size), and adapters sent
    first in the walk (long evicted: beyond both tiers when the walk went round more than three hot tiers).
    """
    rng = random.Random(seed)
    order = list(range(n))
    rng.shuffle(order)
    await bench.timed_call(None)  # the base itself warm: the cold figures are the adapter's cost only
    rss = RssSampler(bench.worker_pid()).start()
    rss_start = rss.sample()
    cold: list[float] = []
    warm: list[float] = []
    probes, rest = order[:cold_samples], order[cold_samples:]
    for k in probes:  # sequential and alone: the first request of an adapter never used, then its second
        cold.append(await bench.timed_call(k, k))
        warm.append(await bench.timed_call(k, k + 1))
    say(f"    cold first request p50 {_stats(cold)['p50_ms']} ms, warm p50 {_stats(warm)['p50_ms']} ms "
        f"({len(cold)} adapters)")
    rss_after_probes = rss.sample()
    churn, seq = await _walk(bench, rest, churn_s, concurrency)
    rss_mid = churn.pop("rss_mid_bytes_probe", None)
    recent = list(dict.fromkeys(seq[max(0, len(seq) - 2 * hot):max(0, len(seq) - hot)]))[:cold_samples]
    recently_evicted = [await bench.timed_call(k, k + 2) for k in recent]
    revisit = [await bench.timed_call(k, k + 2) for k in rest[:cold_samples] if k not in recent]
    await rss.stop()
    values = [v for _, v in rss.samples]
    touched = len(probes) + churn["adapters_touched"]
    out = {
        "adapters_registered": n, "adapter_weights_bytes": adapter_bytes,
        "cold_first_request": _stats(cold), "warm_second_request": _stats(warm),
        "recently_evicted": _stats(recently_evicted), "revisit_long_evicted": _stats(revisit),
        "cold_over_warm_p50": (round(float(np.median(cold)) / float(np.median(warm)), 2) if cold and warm else None),
        "churn": churn,
        "rss_mib": {"start": round(rss_start / MIB, 1), "after_probes": round(rss_after_probes / MIB, 1),
                    "peak": round(max(values) / MIB, 1), "end": round(values[-1] / MIB, 1),
                    "growth_peak_minus_start": round((max(values) - rss_start) / MIB, 1),
                    "samples": len(values)},
        "weights_of_adapters_touched_mib": round(touched * adapter_bytes / MIB, 1),
        "rss_series_mib": [(t, round(v / MIB, 1)) for t, v in rss.samples[:: max(1, len(rss.samples) // 60)]],
    }
    if rss_mid is not None:
        out["rss_mib"]["walk_midpoint"] = round(rss_mid / MIB, 1)
        out["rss_mib"]["growth_second_half_of_walk"] = round((values[-1] - rss_mid) / MIB, 1)
    return out


async def _walk(bench: Bench, order: list[int], seconds: float, concurrency: int
                ) -> tuple[dict[str, Any], list[int]]:
    """`concurrency` clients, each sending the next adapter of `order` (cycled) until `seconds` have passed."""
    proc = psutil.Process(bench.worker_pid())
    lat: list[float] = []
    errors = 0
    nxt = 0
    touched: set[int] = set()
    seq: list[int] = []
    mid: list[int] = []
    t0 = time.perf_counter()
    end = t0 + seconds

    async def client() -> None:
        nonlocal nxt, errors
        while time.perf_counter() < end:
            k = order[nxt % len(order)]
            nxt += 1
            touched.add(k)
            seq.append(k)
            s = time.perf_counter()
            ok = await bench.call(k, nxt)
            if ok:
                lat.append((time.perf_counter() - s) * 1000.0)
            else:
                errors += 1
            if not mid and time.perf_counter() > t0 + seconds / 2:
                mid.append(int(proc.memory_info().rss))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    say(f"    walk: {len(touched)} adapters, {len(lat)} requests in {wall:.1f}s, errors {errors}")
    return {"seconds": round(wall, 1), "concurrency": concurrency, "requests": len(lat), "errors": errors,
            "adapters_touched": len(touched), "throughput_rps": round(len(lat) / wall, 2), **_stats(lat),
            "p99_ms": round(float(np.percentile(lat, 99)), 1) if lat else None,
            **({"rss_mid_bytes_probe": mid[0]} if mid else {})}, seq
