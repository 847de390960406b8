"""Shadow comparison (issue 25, part 5): how a candidate's answers agree with the champion's, and the figures the
gateways keep of it.

Pure text/rank metrics (exact match, chrF, rank overlap) and `ShadowFigures`, the cumulative per-shadow counters one
gateway publishes on `lorafleet.stats.gateway.<id>.shadow` and a collector sums over gateways. In core because the
gateway (serve/) computes them and the registry (registry/) logs them to MLflow: stages never import each other.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from lorafleet.core.heartbeats import STATS_BUCKETS, STATS_PREFIX, bucket_index
from lorafleet.core.wire import pack, unpack

CHRF_ORDER = 6  # character n-grams 1..6, as sacrebleu's chrF
CHRF_BETA = 2.0  # recall weighted twice as much as precision


def _ngrams(text: str, n: int) -> Counter[str]:
    return Counter(text[i:i + n] for i in range(len(text) - n + 1))


def chrf(hypothesis: str, reference: str, order: int = CHRF_ORDER, beta: float = CHRF_BETA) -> float:
    """chrF (Popović 2015) of one sentence pair, 0..100, as sacrebleu's sentence chrF computes it: the F-beta score of
    character n-gram precision and recall averaged over the orders n = 1..order that both texts have, whitespace
    removed. Small and dependency-free: the gateway runs it per compared pair. Two empty texts agree fully (100)."""
    hyp, ref = "".join(hypothesis.split()), "".join(reference.split())
    if not hyp and not ref:
        return 100.0
    precisions, recalls = [], []
    for n in range(1, order + 1):
        h, r = _ngrams(hyp, n), _ngrams(ref, n)
        if not h or not r:  # an order one side is too short for does not count (sacrebleu's effective order)
            continue
        common = sum((h & r).values())
        precisions.append(common / sum(h.values()))
        recalls.append(common / sum(r.values()))
    if not precisions:
        return 0.0
    p, r = sum(precisions) / len(precisions), sum(recalls) / len(recalls)
    if p + r == 0:
        return 0.0
    b2 = beta * beta
    return 100.0 * (1 + b2) * p * r / (b2 * p + r)


def exact_match(a: str, b: str) -> bool:
    """The two answers are the same text (surrounding whitespace aside)."""
    return a.strip() == b.strip()


def rank_overlap(champion: Sequence[int], candidate: Sequence[int], k: int = 10) -> float:
    """Overlap@k of two rankings (document indices, best first), 0..1: the share of the champion's top k that the
    candidate also ranks in its top k (k shrinks to the list's length for short lists; 1.0 for two empty ones)."""
    k = min(k, len(champion), len(candidate))
    if k <= 0:
        return 1.0
    return len(set(champion[:k]) & set(candidate[:k])) / k


def mirror_now(seen: int, percent: float) -> bool:
    """Whether the request numbered `seen` (0, 1, 2, … per name on one gateway) is mirrored at `percent`: exactly
    ⌊n·P/100⌋ of the first n are, spread evenly (never a burst), so the mirrored share is P % from the first
    requests on, without randomness to make a test flaky."""
    p = round(percent * 1000)  # thousandths of a percent, in integers: no float drift over millions of requests
    return (seen + 1) * p // 100_000 > seen * p // 100_000


SHADOW_SUFFIX = "shadow"


def shadow_subject(gateway_id: str) -> str:
    """Where one gateway publishes its shadow figures: under its stats subject (the permissions it already has)."""
    return f"{STATS_PREFIX}.gateway.{gateway_id}.{SHADOW_SUFFIX}"


SHADOW_SUBJECT = f"{STATS_PREFIX}.gateway.*.{SHADOW_SUFFIX}"
_N = len(STATS_BUCKETS) + 1


def _zeros() -> tuple[int, ...]:
    return (0,) * _N


@dataclass(frozen=True, slots=True)
class ShadowFigures:
    """Cumulative comparison of one shadow (name, champion, candidate, started) on one gateway, or summed.

    `eligible`: champion answers the shadow could mirror; `mirrored`: copies published; `shed`: copies dropped under
    load (the backlog, the in-flight cap); `compared`: both sides answered; `errors`: the copy failed."""

    eligible: int = 0
    mirrored: int = 0
    shed: int = 0
    compared: int = 0
    errors: int = 0
    exact: int = 0
    chrf_sum: float = 0.0
    overlap_sum: float = 0.0
    overlaps: int = 0
    champion_seconds: float = 0.0
    candidate_seconds: float = 0.0
    champion_length: int = 0  # characters of the compared answers (or documents ranked, for rerank)
    candidate_length: int = 0
    champion_buckets: tuple[int, ...] = field(default_factory=_zeros)
    candidate_buckets: tuple[int, ...] = field(default_factory=_zeros)

    def __add__(self, other: ShadowFigures) -> ShadowFigures:
        out = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            out[f.name] = tuple(x + y for x, y in zip(a, b, strict=True)) if isinstance(a, tuple) else a + b
        return ShadowFigures(**out)

    def compare(self, champion_s: float, candidate_s: float, champion_len: int, candidate_len: int,
                same: bool, chrf_score: float | None = None, overlap: float | None = None) -> ShadowFigures:
        """These figures with one more compared pair."""
        cb, kb = list(self.champion_buckets), list(self.candidate_buckets)
        cb[bucket_index(champion_s)] += 1
        kb[bucket_index(candidate_s)] += 1
        return replace(self, compared=self.compared + 1, exact=self.exact + int(same),
                       chrf_sum=self.chrf_sum + (chrf_score or 0.0),
                       overlap_sum=self.overlap_sum + (overlap or 0.0),
                       overlaps=self.overlaps + int(overlap is not None),
                       champion_seconds=self.champion_seconds + champion_s,
                       candidate_seconds=self.candidate_seconds + candidate_s,
                       champion_length=self.champion_length + champion_len,
                       candidate_length=self.candidate_length + candidate_len,
                       champion_buckets=tuple(cb), candidate_buckets=tuple(kb))

    def online_metrics(self) -> dict[str, float]:
        """The figures as MLflow metrics of the candidate's run (an online evaluation beside the offline one)."""
        from lorafleet.core.heartbeats import VersionCounts

        out: dict[str, float] = {"online_shadow_eligible": self.eligible, "online_shadow_mirrored": self.mirrored,
                                 "online_shadow_shed": self.shed, "online_shadow_compared": self.compared,
                                 "online_shadow_errors": self.errors}
        if self.mirrored:
            out["online_error_rate"] = self.errors / self.mirrored
        n = self.compared
        if n:
            out["online_exact_match"] = self.exact / n
            if self.overlaps < n:  # text answers (rerank answers are compared by rank overlap only)
                out["online_chrf"] = self.chrf_sum / (n - self.overlaps)
            out["online_latency_ms_champion"] = 1000 * self.champion_seconds / n
            out["online_latency_ms_candidate"] = 1000 * self.candidate_seconds / n
            if self.champion_seconds > 0:
                out["online_latency_ratio"] = self.candidate_seconds / self.champion_seconds
            out["online_length_champion"] = self.champion_length / n
            out["online_length_candidate"] = self.candidate_length / n
            if self.champion_length > 0:
                out["online_length_ratio"] = self.candidate_length / self.champion_length
            for side, buckets in (("champion", self.champion_buckets), ("candidate", self.candidate_buckets)):
                p99 = VersionCounts(n, 0, buckets).quantile(0.99)
                if p99 != float("inf"):
                    out[f"online_p99_ms_{side}"] = 1000 * p99
        if self.overlaps:
            out["online_rank_overlap"] = self.overlap_sum / self.overlaps
        return {k: float(v) for k, v in out.items()}


ShadowKey = tuple[str, str, str, float]  # (name, champion version, candidate version, shadow started)


@dataclass(frozen=True, slots=True)
class GatewayShadowStats:
    """One gateway's cumulative shadow figures, per shadow it has applied."""

    gateway: str
    shadows: dict[ShadowKey, ShadowFigures]
    ts: float = field(default_factory=time.time)

    def to_wire(self) -> bytes:
        rows = []
        for (name, champ, cand, started), f in sorted(self.shadows.items()):
            rows.append([name, champ, cand, started,
                         {x.name: list(v) if isinstance(v := getattr(f, x.name), tuple) else v for x in fields(f)}])
        return pack({"v": 1, "gateway": self.gateway, "ts": self.ts, "shadows": rows})

    @classmethod
    def from_wire(cls, data: bytes) -> GatewayShadowStats:
        d: Any = unpack(data)
        shadows = {}
        for name, champ, cand, started, raw in d["shadows"]:
            kw = {k: tuple(int(x) for x in raw[k]) if k.endswith("_buckets") else raw[k]
                  for k in (f.name for f in fields(ShadowFigures)) if k in raw}
            if any(len(kw.get(k, _zeros())) != _N for k in ("champion_buckets", "candidate_buckets")):
                raise ValueError("latency buckets differ from STATS_BUCKETS")
            shadows[(str(name), str(champ), str(cand), float(started))] = ShadowFigures(**kw)
        return cls(str(d["gateway"]), shadows, float(d.get("ts", 0.0)))


def summed(latest: dict[str, GatewayShadowStats], key: ShadowKey) -> ShadowFigures:
    """One shadow's figures summed over the latest message of each gateway (each is cumulative since that gateway
    applied the shadow)."""
    out = ShadowFigures()
    for stats in latest.values():
        if key in stats.shadows:
            out = out + stats.shadows[key]
    return out
