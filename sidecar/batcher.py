"""Batch forming: group pulled tasks by (base, adapter), sort by length, cut under a token budget.

Pure logic (no NATS, no torch) so it is unit-tested directly. The cost of a batch is its padded
size, items × longest item, because that is what the model computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from lorafleet.config import ServingProfile
from lorafleet.wire import EMBED, GenerateParams, Task

ProfileFor = Callable[[str, str | None], ServingProfile]


@dataclass(slots=True)
class Pulled:
    """One decoded task and the JetStream message that carries it (ack/nak/term go to `msg`)."""

    task: Task
    msg: Any
    pulled_at: float = 0.0  # monotonic
    params: GenerateParams | None = None  # a generate task's parameters, checked at intake


@dataclass(slots=True)
class Batch:
    base: str
    adapter: str | None
    items: list[Pulled]
    profile: ServingProfile
    seq: int = field(default=0)
    op: str = EMBED  # the capability every task of the batch asks for

    @property
    def cost(self) -> int:
        return padded_cost([p.task.tokens for p in self.items])

    def __len__(self) -> int:
        return len(self.items)


def item_tokens(task: Task) -> int:
    # A task that claims 0 tokens still costs a forward slot ([CLS]/[SEP] at least).
    return max(int(task.tokens), 1)


def padded_cost(tokens: Iterable[int]) -> int:
    toks = [max(int(t), 1) for t in tokens]
    return len(toks) * max(toks) if toks else 0


def split_group(items: list[Pulled], profile: ServingProfile) -> list[list[Pulled]]:
    """Cut one (base, adapter) group into batches: shortest first, each within items cap and token budget.

    Sorting ascending makes the newest item the longest, so the padded cost of adding it is
    (count + 1) × its tokens. An item longer than the whole budget goes alone.
    """
    ordered = sorted(items, key=lambda p: item_tokens(p.task))
    batches: list[list[Pulled]] = []
    current: list[Pulled] = []
    for p in ordered:
        tokens = item_tokens(p.task)
        fits = len(current) < profile.max_batch_items and (len(current) + 1) * tokens <= profile.max_batch_tokens
        if current and not fits:
            batches.append(current)
            current = []
        current.append(p)
    if current:
        batches.append(current)
    return batches


def form_batches(items: Iterable[Pulled], profile_for: ProfileFor) -> list[Batch]:
    """Group by (base, adapter, capability) in order of first arrival, then split each group under its profile."""
    groups: dict[tuple[str, str | None, str], list[Pulled]] = {}
    for p in items:
        groups.setdefault((p.task.base, p.task.adapter, p.task.op), []).append(p)
    out: list[Batch] = []
    for (base, adapter, op), group in groups.items():
        profile = profile_for(base, adapter)
        out.extend(Batch(base, adapter, chunk, profile, op=op) for chunk in split_group(group, profile))
    return out
