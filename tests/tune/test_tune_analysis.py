"""Pure logic of the sweep: Pareto front, recommendation under SLO and memory, plateau detection."""

from __future__ import annotations

from lorafleet.core.config import ServingProfile
from lorafleet.tune.analysis import ProfileResult, pareto_front, plateaued, recommend


def _r(items: int, rps: float, p99: float | None, rss: float = 500.0, errors: int = 0) -> ProfileResult:
    return ProfileResult(ServingProfile(max_batch_items=items), "items", rps, None if p99 is None else p99 / 2, p99,
                         rss, errors=errors)


def test_pareto_front_keeps_only_undominated() -> None:
    a, b, c, d = _r(1, 70, 40), _r(8, 130, 60), _r(16, 120, 80), _r(32, 140, 300)
    front = pareto_front([a, b, c, d, _r(64, 200, 10, errors=3)])
    assert front == [a, b, d]  # c is beaten by b on both; the erroring profile never counts


def test_recommend_highest_throughput_within_slo_and_memory() -> None:
    a, b, c = _r(1, 70, 40, rss=400), _r(8, 130, 60, rss=900), _r(32, 140, 300, rss=500)
    rec = recommend([a, b, c], slo_p99_ms=100, memory_mb=None)
    assert rec is not None and rec.result is b and rec.meets_slo
    rec = recommend([a, b, c], slo_p99_ms=100, memory_mb=800)
    assert rec is not None and rec.result is a and "memory" in rec.reason
    rec = recommend([a, b, c], slo_p99_ms=1000, memory_mb=None)
    assert rec is not None and rec.result is c


def test_recommend_when_nothing_meets_the_slo() -> None:
    rec = recommend([_r(1, 70, 400), _r(8, 130, 600)], slo_p99_ms=100, memory_mb=None)
    assert rec is not None and not rec.meets_slo and rec.result.p99_ms == 400
    assert recommend([_r(1, 70, None)], 100, None) is None


def test_plateau() -> None:
    assert not plateaued([70], 0.05, 1)
    assert not plateaued([70, 120], 0.05, 1)
    assert plateaued([70, 120, 122], 0.05, 1)
    assert not plateaued([70, 120, 122], 0.05, 2)
    assert plateaued([70, 120, 122, 110], 0.05, 2)
    assert not plateaued([70, 120, 122, 130], 0.05, 2)


def test_score_prefers_slo_then_throughput_else_latency() -> None:
    from lorafleet.tune.analysis import score

    fast_slow, quick_low = _r(32, 140, 300), _r(16, 130, 200)
    assert max([fast_slow, quick_low], key=lambda r: score(r, 100, None)) is quick_low  # none fits: lower p99
    assert max([fast_slow, quick_low], key=lambda r: score(r, 1000, None)) is fast_slow  # both fit: throughput
    assert score(_r(8, 500, 10, errors=1), 100, None) < score(fast_slow, 100, None)
