"""The promotion gate as pure logic: champion, base + relative margin, missing metrics (task kind: retrieval)."""

from __future__ import annotations

from lorafleet.registry.promote import check_gate
from lorafleet.registry.store import VersionInfo


def _v(version: str, score: float | None, base: float | None = 0.40) -> VersionInfo:
    tags = {}
    if score is not None:
        tags["test_ndcg_at_10"] = str(score)
    if base is not None:
        tags["base_test_ndcg_at_10"] = str(base)
    return VersionInfo(name="legal", version=version, source="file:///x", run_id=None, tags=tags)


def test_passes_above_base_and_champion() -> None:
    gate = check_gate(_v("3", 0.50), _v("2", 0.48), margin=0.05)
    assert gate.ok and gate.reasons == [] and gate.champion_score == 0.48


def test_fails_below_champion_by_how_much() -> None:
    gate = check_gate(_v("3", 0.47), _v("2", 0.50), margin=0.0)
    assert not gate.ok
    assert gate.reasons == ["test_ndcg@10 0.4700 is 0.0300 below the champion v2's 0.5000"]
    assert gate.metric == "test_ndcg@10"  # the retrieval kind's headline: no metric name is a constant here


def test_fails_below_base_plus_relative_margin() -> None:
    assert check_gate(_v("1", 0.42), None, margin=0.05).ok  # 0.40 × 1.05 = 0.42: exactly enough
    gate = check_gate(_v("1", 0.42), None, margin=0.10)
    assert not gate.ok
    assert gate.reasons == ["test_ndcg@10 0.4200 is 0.0200 below what it needs: the base model's 0.4000 and a "
                            "relative margin of 10.0% (0.4400)"]


def test_same_version_as_champion_is_not_compared_with_itself() -> None:
    assert check_gate(_v("2", 0.45), _v("2", 0.45), margin=0.0).ok


def test_missing_metrics_fail() -> None:
    assert "has no test_ndcg@10 recorded" in check_gate(_v("1", None), None, 0.0).reasons[0]
    assert "has no base_test_ndcg@10 recorded" in check_gate(_v("1", 0.5, base=None), None, 0.0).reasons[0]


def _on(info: VersionInfo, digest: str | None) -> VersionInfo:
    if digest is not None:
        info.tags["dataset_digest"] = digest
    return info


def test_test_numbers_from_different_datasets_are_not_compared() -> None:
    """`not behind the champion` compares test scores; from two test sets they say nothing about each other."""
    gate = check_gate(_on(_v("3", 0.50), "aaaa1111bbbb"), _on(_v("2", 0.60), "cccc2222dddd"), margin=0.0)
    assert not gate.ok
    assert gate.reasons == ["v3 was scored on dataset aaaa1111bbbb, the champion v2 on dataset cccc2222dddd: their "
                            "test_ndcg@10 numbers are not comparable. Re-evaluate the champion on v3's dataset "
                            "(train it again on that data) or promote with --force"]
    # A better score on another dataset is not comparable either: the refusal does not depend on the numbers.
    assert not check_gate(_on(_v("3", 0.70), "aaaa1111bbbb"), _on(_v("2", 0.60), "cccc2222dddd"), margin=0.0).ok
    # Same dataset: compared as before.
    assert check_gate(_on(_v("3", 0.61), "aaaa1111bbbb"), _on(_v("2", 0.60), "aaaa1111bbbb"), margin=0.0).ok
    # A version registered without a digest cannot be checked: compared as before (older registries).
    assert check_gate(_on(_v("3", 0.61), "aaaa1111bbbb"), _v("2", 0.60), margin=0.0).ok
