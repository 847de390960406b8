"""`promote --canary P --watch`: the pure parts (verdict, p99 from summed deltas, the tally over gateways, the
stats wire format, who watches). The loop against a real fleet is tests/integration/test_canary_watch.py."""

from __future__ import annotations

import time

import pytest

from lorafleet.core.heartbeats import STATS_BUCKETS, GatewayStats, VersionCounts, bucket_index
from lorafleet.core.wire import WireError
from lorafleet.nats.auth import PERMISSIONS
from lorafleet.registry.canary import CanaryError, watch_line
from lorafleet.registry.watch import Margins, Tally, judge
from lorafleet.serve.metrics import GatewayMetrics


def counts(requests: int, errors: int = 0, latency: float = 0.01) -> VersionCounts:
    """`requests` all of one latency."""
    b = [0] * (len(STATS_BUCKETS) + 1)
    b[bucket_index(latency)] = requests
    return VersionCounts(requests, errors, tuple(b))


M = Margins(max_error_increase=0.01, max_p99_ratio=1.5, min_requests=20)


def test_error_rate_above_margin_fails_with_the_figures() -> None:
    v = judge(counts(200, 1), counts(50, 5), M)
    assert v.decision == "fail"
    assert "10.00 %" in v.reason and "0.50 %" in v.reason and "5 of 50" in v.reason


def test_error_rate_within_margin_passes() -> None:
    assert judge(counts(1000, 10), counts(100, 1), M).decision == "pass"  # 1 % vs 1 %


def test_too_few_candidate_requests_waits_even_if_all_failed() -> None:
    v = judge(counts(500), counts(19, 19), M)
    assert v.decision == "wait" and "19" in v.reason


def test_a_failing_candidate_fails_before_the_champion_has_its_minimum() -> None:
    # every canary request fails: waiting for the champion's traffic would only cost more failures
    assert judge(counts(3), counts(20, 20), M).decision == "fail"


def test_latency_needs_the_champions_minimum() -> None:
    assert judge(counts(5), counts(100, latency=5.0), M).decision == "wait"


def test_p99_above_ratio_fails_and_at_ratio_passes() -> None:
    slow = judge(counts(100, latency=0.01), counts(100, latency=0.05), M)
    assert slow.decision == "fail" and "p99 50 ms" in slow.reason and "10 ms" in slow.reason
    # 0.015 = 1.5 × 0.01 exactly: allowed
    assert judge(counts(100, latency=0.01), counts(100, latency=0.015), M).decision == "pass"


def test_quantile_is_the_bucket_bound_and_inf_above_the_last() -> None:
    c = counts(99, latency=0.004) + counts(1, latency=120.0)
    assert c.quantile(0.99) == 0.005
    assert c.quantile(1.0) == float("inf")
    assert VersionCounts().quantile(0.99) == 0.0


def test_p99_from_deltas_summed_over_gateways() -> None:
    """p99 of the fleet's traffic, not of one gateway's: gw-a alone sees a slow p99 (5 slow of 100), the sum
    over both gateways a fast one (5 slow of 1000); and what the gateways counted before the watch (their first
    message) does not count."""
    t = Tally()
    key = ("spec", "2")
    old = counts(1000, 1000, latency=30.0)  # before the watch: slow and failing, must not count
    t.add(GatewayStats("gw-a", {key: old}))
    t.add(GatewayStats("gw-b", {key: old}))
    a = old + counts(95, latency=0.01) + counts(5, latency=2.0)
    b = old + counts(900, latency=0.01)
    t.add(GatewayStats("gw-a", {key: a}))
    t.add(GatewayStats("gw-b", {key: b}))
    total = t.total(*key)
    assert (total.requests, total.errors) == (1000, 0)
    assert (a - old).quantile(0.99) == 2.0  # one gateway's view
    assert total.quantile(0.99) == 0.01  # the fleet's
    assert (total + counts(10, latency=2.0)).quantile(0.99) == 2.0  # 15 of 1010 slow: above 1 %
    assert t.total("spec", "1") == VersionCounts()


def test_a_restarted_gateway_keeps_what_it_counted() -> None:
    t = Tally()
    key = ("spec", "2")
    t.add(GatewayStats("gw-a", {key: counts(10)}))
    t.add(GatewayStats("gw-a", {key: counts(40, 4)}))  # +30, 4 errors
    t.add(GatewayStats("gw-a", {key: counts(5, 5)}))  # restarted: 5 new, all failed
    total = t.total(*key)
    assert (total.requests, total.errors) == (35, 9)


def test_stats_wire_round_trip_and_malformed() -> None:
    s = GatewayStats("gw-1", {("spec", "2"): counts(7, 2), ("spec", "1"): counts(3)}, ts=12.5)
    assert GatewayStats.from_wire(s.to_wire()) == s
    with pytest.raises(WireError):
        GatewayStats.from_wire(b"\x00garbage")
    bad = GatewayStats("gw-1", {("spec", "2"): VersionCounts(1, 0, (1,))})
    with pytest.raises(WireError):
        GatewayStats.from_wire(bad.to_wire())


def test_gateway_metrics_count_5xx_as_errors_per_version() -> None:
    m = GatewayMetrics(lambda: 0.0)
    assert m.version_stats("gw") is None
    m.request_done("chat", "spec", 200, 0.004, "1")
    m.request_done("chat", "spec", 502, 0.2, "2")
    m.request_done("chat", "spec", 429, 0.001, "2")  # refused: not the candidate's fault
    m.request_done("chat", "other", 200, 0.004)  # no version: not published
    stats = m.version_stats("gw")
    assert stats is not None and set(stats.versions) == {("spec", "1"), ("spec", "2")}
    two = stats.versions[("spec", "2")]
    assert (two.requests, two.errors) == (2, 1)
    assert two.buckets[bucket_index(0.2)] == 1 and two.buckets[bucket_index(0.001)] == 1


def test_margins_refuse_nonsense() -> None:
    with pytest.raises(CanaryError):
        Margins(max_error_increase=-0.01)
    with pytest.raises(CanaryError):
        Margins(max_p99_ratio=0.9)
    with pytest.raises(CanaryError):
        Margins(min_requests=0)


def test_status_says_watched_only_while_the_watcher_is_heard_and_its_window_runs() -> None:
    now = time.time()
    c = {"name": "spec", "watcher": "h1/42", "watch_until": now + 60}
    heard = {"control/watch-spec": {"host": "h1", "pid": 42}}
    assert watch_line(c, heard, now).startswith("watched by h1/42 until ")
    assert watch_line(c, {}, now).startswith("nobody watches")  # the watcher died: the spec still names it
    assert watch_line(c, {"control/watch-spec": {"host": "h1", "pid": 43}}, now).startswith("nobody watches")
    assert watch_line({**c, "watch_until": now - 1}, heard, now).startswith("nobody watches")
    assert watch_line({"name": "spec", "watcher": None, "watch_until": None}, heard, now).startswith("nobody")


def test_permissions_let_gateways_publish_and_control_read_the_figures() -> None:
    assert "lorafleet.stats.gateway.>" in PERMISSIONS["gateway"].publish
    assert "lorafleet.stats.gateway.>" in PERMISSIONS["control"].subscribe
    assert "lorafleet.presence.control.>" in PERMISSIONS["control"].publish
    assert not any(s.startswith("lorafleet.stats") for s in PERMISSIONS["worker"].publish)


@pytest.mark.parametrize(("args", "says"), [
    (["--watch", "soon"], "--watch"),
    (["--watch", "forever"], "finite duration"),
    (["--watch", "0"], "finite duration"),
    (["--watch", "10m", "--abort"], "do not go together"),
    (["--watch", "10m", "--max-p99-ratio", "0.5"], "--max-p99-ratio"),
    (["--canary", "20", "--watch", "10m", "--max-error-increase", "-1"], "--max-error-increase"),
])
def test_watch_flags_refused_before_touching_anything(args: list[str], says: str) -> None:
    from typer.testing import CliRunner

    from lorafleet.cli import app

    out = CliRunner().invoke(app, ["promote", "spec", *args])
    assert out.exit_code == 1, out.output
    assert says in out.output
