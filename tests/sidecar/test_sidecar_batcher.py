"""Batch forming: grouping by (base, adapter), length sort, item cap, padded token budget."""

from __future__ import annotations

import itertools

from lorafleet.config import ServingProfile
from lorafleet.sidecar.batcher import ProfileFor, Pulled, form_batches, padded_cost, split_group
from lorafleet.wire import Task

_ids = itertools.count()


def pulled(tokens: int, base: str = "m", adapter: str | None = None) -> Pulled:
    n = next(_ids)
    return Pulled(Task(id=f"t{n}", request_id="r", index=n, model="m", base=base, text="x", tokens=tokens,
                       deadline=0.0, reply="_INBOX.g.r", adapter=adapter), msg=None)


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
