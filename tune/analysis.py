"""Pure logic of the sweep: the staged profile grid, plateau detection, Pareto front, recommendation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lorafleet.core.config import ServingProfile


@dataclass
class ProfileResult:
    """Everything measured for one serving profile."""

    profile: ServingProfile
    phase: str
    throughput_rps: float  # best closed-loop throughput over the concurrencies
    p50_ms: float | None  # open loop, at the highest offered rate of the series
    p99_ms: float | None
    peak_rss_mb: float
    peak_gpu_mb: float | None = None
    errors: int = 0
    unsent: int = 0  # open-loop requests the server fell too far behind to take: the load was not sustained
    gen_cpu_pct: float = 0.0
    restart_s: float = 0.0
    points: list[dict[str, Any]] = field(default_factory=list)
    on_front: bool = False
    recommended: bool = False
    pairs_per_request: int = 0  # rerankers: (query, document) pairs in each request; 0 for embeddings

    @property
    def pairs_per_s(self) -> float | None:
        return self.throughput_rps * self.pairs_per_request if self.pairs_per_request else None

    def key(self) -> tuple[int, int, float, int, str]:
        p = self.profile
        return (p.max_batch_items, p.max_batch_tokens, p.max_wait_ms, p.batches_in_flight, p.precision or "fp32")

    def row(self) -> dict[str, Any]:
        p = self.profile
        return {"phase": self.phase, "precision": p.precision or "fp32", "max_batch_items": p.max_batch_items,
                "max_batch_tokens": p.max_batch_tokens,
                "max_wait_ms": p.max_wait_ms, "batches_in_flight": p.batches_in_flight,
                "throughput_rps": round(self.throughput_rps, 2), "p50_ms": _r(self.p50_ms), "p99_ms": _r(self.p99_ms),
                "peak_rss_mb": round(self.peak_rss_mb, 1), "peak_gpu_mb": _r(self.peak_gpu_mb),
                "errors": self.errors, "unsent": self.unsent, "gen_cpu_pct": round(self.gen_cpu_pct, 2),
                "restart_s": round(self.restart_s, 2), "on_front": self.on_front, "recommended": self.recommended,
                **({"pairs_per_s": round(self.throughput_rps * self.pairs_per_request, 1)}
                   if self.pairs_per_request else {})}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def pareto_front(results: list[ProfileResult]) -> list[ProfileResult]:
    """Profiles no other profile beats on both throughput (higher) and p99 (lower); sorted by throughput."""
    valid = [r for r in results if r.p99_ms is not None and r.errors == 0 and r.unsent == 0]
    front = []
    for r in valid:
        dominated = any(
            o is not r and o.throughput_rps >= r.throughput_rps and o.p99_ms <= r.p99_ms  # type: ignore[operator]
            and (o.throughput_rps > r.throughput_rps or o.p99_ms < r.p99_ms)  # type: ignore[operator]
            for o in valid
        )
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: r.throughput_rps)


@dataclass
class Recommendation:
    result: ProfileResult
    meets_slo: bool
    reason: str


def recommend(results: list[ProfileResult], slo_p99_ms: float, memory_mb: float | None) -> Recommendation | None:
    """Highest throughput within the p99 SLO and memory limit; else the lowest-p99 profile, flagged."""
    valid = [r for r in results if r.p99_ms is not None and r.errors == 0 and r.unsent == 0]
    if not valid:
        return None
    fits = [r for r in valid if r.p99_ms <= slo_p99_ms  # type: ignore[operator]
            and (memory_mb is None or r.peak_rss_mb <= memory_mb)]
    if fits:
        best = max(fits, key=lambda r: (r.throughput_rps, -(r.p99_ms or 0.0)))
        return Recommendation(best, True, f"highest throughput with p99 ≤ {slo_p99_ms:g} ms"
                              + (f" and memory ≤ {memory_mb:.0f} MB" if memory_mb else ""))
    in_memory = [r for r in valid if memory_mb is None or r.peak_rss_mb <= memory_mb] or valid
    best = min(in_memory, key=lambda r: r.p99_ms)  # type: ignore[arg-type, return-value]
    return Recommendation(best, False, f"no profile met p99 ≤ {slo_p99_ms:g} ms; this one has the lowest p99")


def plateaued(history: list[float], gain: float, patience: int) -> bool:
    """True when the last `patience` values each failed to beat the best before them by `gain` (relative)."""
    if len(history) <= patience:
        return False
    return all(history[i] <= max(history[:i]) * (1.0 + gain) for i in range(len(history) - patience, len(history)))


def score(r: ProfileResult, slo_p99_ms: float, memory_mb: float | None) -> tuple[int, float]:
    """Order for choosing the centre of the next sweep phase, the same preference as `recommend`:
    inside the limits by throughput; outside them (nothing fits yet) by lower p99."""
    if r.errors or r.unsent or r.p99_ms is None:
        return (-1, r.throughput_rps)
    inside = r.p99_ms <= slo_p99_ms and (memory_mb is None or r.peak_rss_mb <= memory_mb)
    return (1, r.throughput_rps) if inside else (0, -r.p99_ms)
