"""Batch forming: group pulled tasks by (base, adapter), sort by length, cut under a token budget.

Embed and score tasks of a base whose runtime runs mixed-adapter batches are grouped by (base, capability)
alone: one forward pass serves rows of many adapters (and of the bare base), so spread traffic still fills a
batch. Such a batch
holds at most `max_batch_adapters` distinct adapters (all stay loaded while it computes) and keeps the
tightest item cap and token budget of its adapters' profiles.

Pure logic (no NATS, no torch) so it is unit-tested directly. The cost of a batch is its padded
size, items × longest item, because that is what the model computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from lorafleet.core.config import ServingProfile
from lorafleet.core.wire import EMBED, SCORE, GenerateParams, Task

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
    adapter: str | None  # None when mixed
    items: list[Pulled]
    profile: ServingProfile
    seq: int = field(default=0)
    op: str = EMBED  # the capability every task of the batch asks for
    mixed: bool = False  # rows of several adapters (or adapters and the bare base): each task's adapter is its own

    def adapters(self) -> list[str]:
        """The distinct adapters this batch needs loaded, in order of first row (the bare base excluded)."""
        if not self.mixed:
            return [] if self.adapter is None else [self.adapter]
        return list(dict.fromkeys(p.task.adapter for p in self.items if p.task.adapter is not None))

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


_MIXED: Any = object()  # the group key of a base's mixed tasks, unlike any adapter id
MIXABLE_OPS = frozenset({EMBED, SCORE})  # generation runs per adapter (its runtimes batch one adapter at a time)


def form_batches(items: Iterable[Pulled], profile_for: ProfileFor, mixed_bases: frozenset[str] = frozenset(),
                 max_batch_adapters: int | None = None) -> list[Batch]:
    """Group by (base, adapter, capability) in order of first arrival, then split each group under its profile.

    Embed and score tasks of a base in `mixed_bases` group by (base, capability) instead (see `split_mixed`); a
    batch of them that ends up with rows of one adapter only is an ordinary one-adapter batch.
    """
    groups: dict[tuple[str, str | None, str], list[Pulled]] = {}
    for p in items:
        key = _MIXED if p.task.op in MIXABLE_OPS and p.task.base in mixed_bases else p.task.adapter
        groups.setdefault((p.task.base, key, p.task.op), []).append(p)
    out: list[Batch] = []
    for (base, adapter, op), group in groups.items():
        if adapter is _MIXED:
            for chunk, profile in split_mixed(group, partial(profile_for, base), max_batch_adapters):
                names = {p.task.adapter for p in chunk}
                single = len(names) == 1
                out.append(Batch(base, names.pop() if single else None, chunk, profile, op=op, mixed=not single))
            continue
        profile = profile_for(base, adapter)
        out.extend(Batch(base, adapter, chunk, profile, op=op) for chunk in split_group(group, profile))
    return out


def split_mixed(items: list[Pulled], profile_of: Callable[[str | None], ServingProfile],
                max_adapters: int | None) -> list[tuple[list[Pulled], ServingProfile]]:
    """Cut one base's tasks of many adapters into batches, as `split_group` does, under the tightest item cap
    and token budget of the adapters in each batch and at most `max_adapters` distinct adapters per batch.

    Sorted ascending, the newest item is the longest: the batch with it costs (count + 1) × its tokens, so
    checking that against the limits tightened by its adapter's profile keeps the whole batch within them.
    """
    profiles: dict[str | None, ServingProfile] = {}
    batches: list[tuple[list[Pulled], ServingProfile]] = []
    current: list[Pulled] = []
    names: set[str] = set()
    limits = ServingProfile()  # the current batch's: its first item's profile, tightened by the others'
    for p in sorted(items, key=lambda p: item_tokens(p.task)):
        adapter = p.task.adapter
        if adapter not in profiles:
            profiles[adapter] = profile_of(adapter)
        prof = profiles[adapter]
        if current:
            tight = _tighten(limits, prof)
            too_many = (adapter is not None and adapter not in names and max_adapters is not None
                        and len(names) >= max_adapters)
            if (len(current) < tight.max_batch_items and not too_many
                    and (len(current) + 1) * item_tokens(p.task) <= tight.max_batch_tokens):
                limits = tight
            else:
                batches.append((current, limits))
                current, names = [], set()
        if not current:
            limits = prof
        current.append(p)
        if adapter is not None:
            names.add(adapter)
    if current:
        batches.append((current, limits))
    return batches


def _tighten(limits: ServingProfile, other: ServingProfile) -> ServingProfile:
    # `limits` with the smaller item cap and token budget of the two (itself when it is already as tight).
    cap = min(limits.max_batch_items, other.max_batch_items)
    budget = min(limits.max_batch_tokens, other.max_batch_tokens)
    if (limits.max_batch_items, limits.max_batch_tokens) == (cap, budget):
        return limits
    return limits.model_copy(update={"max_batch_items": cap, "max_batch_tokens": budget})


def padding_cuts(lengths: Sequence[int], overhead_tokens: float) -> list[int]:
    """Where to cut `lengths` (sorted ascending) into forward passes: the end index of each pass.

    A pass costs its padded size (items × longest) plus `overhead_tokens`, the fixed cost of one forward pass
    expressed in padded tokens; the cuts minimise the total (dynamic programming over the sorted list, n² steps for
    the few dozen rows of a batch). With no overhead every distinct length would go alone; with a large one
    nothing is cut. A pulled window of arrivals is padded to its longest item, so cutting it where lengths jump
    saves what the length-sorted ceiling saves.
    """
    n = len(lengths)
    if n <= 1:
        return [n] if n else []
    toks = [max(int(t), 1) for t in lengths]
    best = [0.0] + [float("inf")] * n  # best[j]: the cheapest way to compute the first j rows
    prev = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = toks[j - 1]  # sorted: the last row of a pass is its longest
        for i in range(j):
            cost = best[i] + (j - i) * longest + overhead_tokens
            if cost < best[j]:
                best[j], prev[j] = cost, i
    cuts: list[int] = []
    j = n
    while j > 0:
        cuts.append(j)
        j = prev[j]
    return cuts[::-1]
