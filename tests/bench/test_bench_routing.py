"""bench/routing.py --quick: pull, stale push and fresh push on the equal and slow scenarios."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_routing_quick_writes_results(run_quick) -> None:  # type: ignore[no-untyped-def]
    data = run_quick("routing")
    for name in ("equal", "slow"):
        scenario = data["scenarios"][name]
        assert "error" not in scenario, scenario
        assert set(scenario["policies"]) == {"pull", "push-stale", "push-fresh"}
        assert all(p["points"] for p in scenario["policies"].values())
    assert "pull_never_below_stale_push" in data["targets"]


def test_routing_replicated_quick(run_quick) -> None:  # type: ignore[no-untyped-def]
    """The replication scenario: pull on one node (R1) and on a 3-node cluster (R3), with their ratio."""
    data = run_quick("routing", "--scenarios", "replicated")
    scenario = data["scenarios"]["replicated"]
    assert "error" not in scenario, scenario
    assert set(scenario["policies"]) == {"pull-r1", "pull-r3"}
    assert all(p["points"] for p in scenario["policies"].values())
    assert set(scenario["ratios"]["r3/r1"]) == {"max_rate_within_slo", "saturation"}
    assert data["targets"] == {}  # pull vs push was not run
