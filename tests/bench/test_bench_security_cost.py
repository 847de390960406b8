"""bench/serve.py's comparison of NATS with authentication and TLS against none (issue 12), pure logic."""

from __future__ import annotations

from lorafleet.bench.serve_report import security_cost


def _pts(c1_p50: float, c32_rps: float) -> dict[int, dict[str, float]]:
    return {1: {"p50_ms": c1_p50, "throughput_rps": 60.0}, 32: {"p50_ms": 200.0, "throughput_rps": c32_rps}}


def test_medians_over_alternated_runs_against_the_targets() -> None:
    pts = {"lorafleet-open": _pts(16.0, 140.0), "lorafleet-tls": _pts(16.3, 139.0),
           "lorafleet-open#2": _pts(15.0, 146.0), "lorafleet-tls#2": _pts(16.1, 141.0), "naive": _pts(13.0, 100.0)}
    cost = security_cost(pts)
    assert cost is not None
    assert cost["c32_rps"] == {"tls": 140.0, "open": 143.0} and cost["c1_p50_ms"] == {"tls": 16.2, "open": 15.5}
    assert cost["c32_throughput_ratio"] == round(140 / 143, 3) and cost["c1_p50_delta_ms"] == 0.7
    assert cost["runs"] == {"tls": 2, "open": 2} and not cost["met"]  # +0.7 ms misses the +0.5 ms target
    assert security_cost({"lorafleet": _pts(16.0, 140.0)}) is None  # nothing to compare
