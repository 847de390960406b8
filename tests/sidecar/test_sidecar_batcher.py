"""Batch forming: grouping by (base, adapter) or, for mixed bases, by base; length sort, item cap, padded token
budget, distinct-adapter cap."""

from __future__ import annotations

import itertools

from lorafleet.core.config import ServingProfile
from lorafleet.core.wire import GENERATE, SCORE, Task
from lorafleet.sidecar.batcher import Batch, ProfileFor, Pulled, form_batches, padded_cost, split_group

_ids = itertools.count()


def pulled(tokens: int, base: str = "m", adapter: str | None = None, op: str | None = None) -> Pulled:
    n = next(_ids)
    extra = {"op": op} if op else {}
    return Pulled(Task(id=f"t{n}", request_id="r", index=n, model="m", base=base, text="x", tokens=tokens,
                       deadline=0.0, reply="_INBOX.g.r", adapter=adapter, **extra), msg=None)


def fixed(profile: ServingProfile) -> ProfileFor:
    return lambda base, adapter: profile


def test_padded_cost_is_items_times_longest() -> None:
    assert padded_cost([3, 10, 4]) == 30
    assert padded_cost([]) == 0
    assert padded_cost([0]) == 1  # an empty input still takes a slot


def test_item_cap_splits_and_sorts_by_length() -> None:
    items = [pulled(t) for t in (9, 1, 5, 3, 7)]
    batches = split_group(items, ServingProfile(max_batch_items=2, max_batch_tokens=10_000))
    assert [[p.task.tokens for p in b] for b in batches] == [[1, 3], [5, 7], [9]]


def test_token_budget_counts_padding() -> None:
    items = [pulled(t) for t in (10, 10, 10, 30, 30)]
    # budget 60: three 10s cost 30; adding a 30 would cost 4×30=120 → new batch; two 30s cost 60.
    batches = split_group(items, ServingProfile(max_batch_items=100, max_batch_tokens=60))
    assert [[p.task.tokens for p in b] for b in batches] == [[10, 10, 10], [30, 30]]
    assert all(padded_cost(p.task.tokens for p in b) <= 60 for b in batches)


def test_item_longer_than_budget_goes_alone() -> None:
    items = [pulled(5), pulled(500), pulled(5)]
    batches = split_group(items, ServingProfile(max_batch_items=10, max_batch_tokens=64))
    assert [[p.task.tokens for p in b] for b in batches] == [[5, 5], [500]]


def test_groups_by_base_and_adapter_in_arrival_order() -> None:
    items = [pulled(4, adapter="a"), pulled(4), pulled(4, adapter="b"), pulled(4, adapter="a"),
             pulled(4, base="other"), pulled(4)]
    batches = form_batches(items, fixed(ServingProfile()))
    assert [(b.base, b.adapter, len(b)) for b in batches] == [
        ("m", "a", 2), ("m", None, 2), ("m", "b", 1), ("other", None, 1),
    ]
    assert sum(len(b) for b in batches) == len(items)


def test_profile_per_adapter() -> None:
    small = ServingProfile(max_batch_items=1)
    items = [pulled(4, adapter="tight") for _ in range(3)] + [pulled(4) for _ in range(3)]
    batches = form_batches(items, lambda base, adapter: small if adapter == "tight" else ServingProfile())
    assert [(b.adapter, len(b)) for b in batches] == [("tight", 1)] * 3 + [(None, 3)]
    assert batches[0].profile is small


MIXED = frozenset({"m"})


def shape(batches: list[Batch]) -> list[tuple[str, str | None, bool, list[str | None]]]:
    return [(b.base, b.adapter, b.mixed, [p.task.adapter for p in b.items]) for b in batches]


def test_mixed_base_groups_by_base_not_adapter() -> None:
    items = [pulled(4, adapter="a"), pulled(4), pulled(4, adapter="b"), pulled(4, adapter="a"),
             pulled(4, base="other", adapter="a"), pulled(4, base="other", adapter="b")]
    batches = form_batches(items, fixed(ServingProfile()), mixed_bases=MIXED)
    assert shape(batches) == [
        ("m", None, True, ["a", None, "b", "a"]),  # one batch for base m: rows of a, b and the bare base
        ("other", "a", False, ["a"]), ("other", "b", False, ["b"]),  # not a mixed base: one adapter per batch
    ]
    assert batches[0].adapters() == ["a", "b"]  # distinct, bare base excluded
    assert batches[1].adapters() == ["a"]
    # Without mixed bases, today's grouping.
    assert [(b.adapter, len(b)) for b in form_batches(items, fixed(ServingProfile()))] == [
        ("a", 2), (None, 1), ("b", 1), ("a", 1), ("b", 1)]


def test_mixed_batch_of_one_adapter_is_a_plain_batch() -> None:
    batches = form_batches([pulled(4, adapter="a"), pulled(5, adapter="a")], fixed(ServingProfile()), MIXED)
    assert shape(batches) == [("m", "a", False, ["a", "a"])]
    bare = form_batches([pulled(4), pulled(5)], fixed(ServingProfile()), MIXED)
    assert shape(bare) == [("m", None, False, [None, None])] and bare[0].adapters() == []


def test_generate_tasks_are_never_mixed() -> None:
    items = [pulled(4, adapter="a", op=GENERATE), pulled(4, adapter="b", op=GENERATE), pulled(4, adapter="a"),
             pulled(4, adapter="b"), pulled(4, adapter="a", op=GENERATE)]
    batches = form_batches(items, fixed(ServingProfile()), MIXED)
    assert [(b.op, b.adapter, b.mixed, len(b)) for b in batches] == [
        (GENERATE, "a", False, 2), (GENERATE, "b", False, 1), ("embed", None, True, 2)]


def test_score_tasks_of_a_mixed_base_are_mixed_apart_from_embed_tasks() -> None:
    # Rerank chunks of many adapters share a batch (before: one batch per adapter); never with embed tasks.
    items = [pulled(4, adapter="a", op=SCORE), pulled(4, adapter="b", op=SCORE), pulled(4, adapter="a"),
             pulled(4, op=SCORE), pulled(4, adapter="b")]
    batches = form_batches(items, fixed(ServingProfile()), MIXED)
    assert [(b.op, b.adapter, b.mixed, [p.task.adapter for p in b.items]) for b in batches] == [
        (SCORE, None, True, ["a", "b", None]), ("embed", None, True, ["a", "b"])]
    assert [(b.adapter, b.mixed) for b in form_batches(items[:2], fixed(ServingProfile()))] == [
        ("a", False), ("b", False)]


def test_max_batch_adapters_cuts_a_mixed_batch() -> None:
    # Same length, so the sort keeps arrival order; bare rows do not count towards the cap.
    items = [pulled(4, adapter=a) for a in ["a", "b", None, "a", "c", "d", None, "e"]]
    batches = form_batches(items, fixed(ServingProfile()), MIXED, max_batch_adapters=2)
    assert shape(batches) == [("m", None, True, ["a", "b", None, "a"]),
                              ("m", None, True, ["c", "d", None]), ("m", "e", False, ["e"])]
    assert all(len(b.adapters()) <= 2 for b in batches)
    assert len(form_batches(items, fixed(ServingProfile()), MIXED, max_batch_adapters=5)) == 1


def test_mixed_batch_takes_the_tightest_profile() -> None:
    loose = ServingProfile(max_batch_items=100, max_batch_tokens=10_000)
    few = ServingProfile(max_batch_items=3, max_batch_tokens=10_000)
    small = ServingProfile(max_batch_items=100, max_batch_tokens=40)
    profiles = {"loose": loose, "few": few, "small": small, None: loose}
    items = [pulled(4, adapter="loose") for _ in range(4)] + [pulled(5, adapter="few"), pulled(5)]
    batches = form_batches(items, lambda base, adapter: profiles[adapter], MIXED)
    # Four loose rows fit; the fifth row (few) would make it 5 rows under few's cap of 3: cut.
    assert [len(b) for b in batches] == [4, 2]
    assert batches[0].profile is loose and batches[1].profile.max_batch_items == 3
    assert batches[1].profile.max_batch_tokens == 10_000 and batches[1].mixed
    # small's budget of 40 binds once a small row is in: 4 rows × 10 tokens = 40 fits, a fifth would not.
    items = [pulled(10, adapter="small")] + [pulled(10, adapter="loose") for _ in range(6)]
    batches = form_batches(items, lambda base, adapter: profiles[adapter], MIXED)
    assert [len(b) for b in batches] == [4, 3]
    tight = batches[0].profile
    assert (tight.max_batch_items, tight.max_batch_tokens) == (100, 40) and tight.max_wait_ms == loose.max_wait_ms
    assert batches[1].profile is loose


def test_mixed_batches_keep_length_sort_and_token_budget() -> None:
    adapters = ["a", "b", None, "c"]
    items = [pulled(t, adapter=adapters[i % 4]) for i, t in enumerate((9, 1, 5, 3, 7, 30, 2, 30, 8, 4))]
    profile = ServingProfile(max_batch_items=100, max_batch_tokens=40)
    batches = form_batches(items, fixed(profile), MIXED)
    assert [[p.task.tokens for p in b.items] for b in batches] == [[1, 2, 3, 4, 5], [7, 8, 9], [30], [30]]
    assert [b.items for b in batches] == split_group(items, profile)  # the same cuts as one adapter's group
    assert all(b.cost <= 40 for b in batches)
    assert sorted(p.task.id for b in batches for p in b.items) == sorted(p.task.id for p in items)
