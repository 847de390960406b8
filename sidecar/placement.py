"""Which bases this worker holds, decided from queue pressure, without a central scheduler.

Every worker runs the same pure function over the same view: the queue's pressure per base (JetStream
consumer info: tasks waiting, the age of the oldest) and the live workers' heartbeats (what each holds,
its budget, how busy it is). A base that waits with no free holder is given to the best-placed worker
by a deterministic greedy assignment, so workers that see the same view never both load it; a worker
that sees itself chosen loads it, evicting its least recently used idle bases to make room. Views are
seconds old at worst: a rare double load costs memory until the idle timer drops one copy, never a task.

Anti-thrash: a base is loaded only after its oldest task waited `wait_s` (or at once when nobody holds
it: that task has no one else), never evicted before `min_residency_s`, never while it has work in
flight or waiting, and one load at a time per worker. Pinned bases (`--base`) never move.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class PlacementPolicy:
    """Thresholds of the placement loop (from the fleet file's worker.placement)."""

    wait_s: float = 2.0  # a base's oldest waiting task older than this, with no free holder: load it somewhere
    idle_s: float = 600.0  # a base unused this long is dropped (scale-to-zero within the fleet)
    min_residency_s: float = 120.0  # never evict a base loaded less than this ago
    busy_load: float = 0.8  # a worker busier than this (fraction of time computing) is not a free holder


@dataclass(frozen=True)
class Pressure:
    """One base as the queue shows it."""

    waiting: int = 0  # tasks not yet delivered to any worker
    oldest_wait_s: float = 0.0  # age of the oldest of them
    in_flight: int = 0  # delivered, not yet acknowledged


@dataclass(frozen=True)
class Peer:
    """One live worker as its heartbeat shows it (this worker's own entry is computed, not read)."""

    worker: str
    budget_mb: int
    used_mb: int
    held: frozenset[str]  # resident or loading
    free_mb_if_evicted: int = 0  # what evicting its evictable bases would add to budget - used
    load: float = 0.0


@dataclass(frozen=True)
class Resident:
    """A base this worker holds."""

    base: str
    memory_mb: int
    loaded_at: float
    last_used: float
    in_flight: int = 0
    pinned: bool = False


Action = Literal["load", "evict"]


@dataclass(frozen=True)
class Move:
    """A placement change and why: 'cold' (nobody held it), 'pressure', 'idle', 'evicted for X', 'pinned'."""

    base: str
    action: Action
    reason: str
    at: float


@dataclass(frozen=True)
class Plan:
    """What to do now: evict these (in order), then load that."""

    evict: tuple[Move, ...] = ()
    load: Move | None = None

    @property
    def empty(self) -> bool:
        return not self.evict and self.load is None


@dataclass(frozen=True)
class View:
    """Everything one decision reads; built fresh at each check."""

    me: str
    budget_mb: int
    residents: tuple[Resident, ...]
    memory_mb: Mapping[str, int]  # every base of the fleet: its resident memory (declared or measured)
    pressure: Mapping[str, Pressure]
    peers: Mapping[str, Peer] = field(default_factory=dict)  # live workers other than me
    my_load: float = 0.0
    loading: str | None = None  # a load of mine in progress


def holdable(memory_mb: int, budgets_mb: list[int]) -> bool:
    """Whether some worker could ever hold a base of this size (the gateway's 503 test)."""
    return any(memory_mb <= b for b in budgets_mb)


def evictable(r: Resident, pressure: Pressure, now: float, policy: PlacementPolicy) -> bool:
    return (not r.pinned and r.in_flight == 0 and pressure.waiting == 0 and pressure.in_flight == 0
            and now - r.loaded_at >= policy.min_residency_s)


def self_peer(view: View, now: float, policy: PlacementPolicy) -> Peer:
    """This worker as the others will see it in its heartbeat."""
    used = sum(r.memory_mb for r in view.residents)
    loading = view.memory_mb.get(view.loading, 0) if view.loading else 0
    spare = sum(r.memory_mb for r in view.residents
                if evictable(r, view.pressure.get(r.base, Pressure()), now, policy))
    held = {r.base for r in view.residents} | ({view.loading} if view.loading else set())
    return Peer(view.me, view.budget_mb, used + loading, frozenset(held), spare, view.my_load)


def _needs_a_holder(base: str, p: Pressure, peers: Mapping[str, Peer], policy: PlacementPolicy) -> str | None:
    """'cold' or 'pressure' when `base` should gain a holder, else None."""
    if p.waiting == 0:
        return None
    holders = [w for w in peers.values() if base in w.held]
    if not holders:
        return "cold"
    if p.oldest_wait_s >= policy.wait_s and all(w.load >= policy.busy_load for w in holders):
        return "pressure"
    return None


def _fits(w: Peer, memory_mb: int) -> bool:
    return w.budget_mb - w.used_mb + w.free_mb_if_evicted >= memory_mb


def _assign(view: View, everyone: Mapping[str, Peer], policy: PlacementPolicy) -> tuple[str, str] | None:
    """The base this worker should load and why, by the greedy assignment every worker computes alike."""
    wanted = []
    for base, p in view.pressure.items():
        reason = _needs_a_holder(base, p, everyone, policy)
        if reason and base in view.memory_mb:
            wanted.append((reason != "cold", -p.oldest_wait_s, base, reason))
    taken: set[str] = set()
    for _, _, base, reason in sorted(wanted):
        need = view.memory_mb[base]
        fit = [w for w in everyone.values()
               if w.worker not in taken and base not in w.held and _fits(w, need)
               and (reason == "cold" or w.load < policy.busy_load)]
        if not fit:
            continue
        best = min(fit, key=lambda w: (w.load, -(w.budget_mb - w.used_mb), w.worker))
        if best.worker == view.me:
            return base, reason
        taken.add(best.worker)
    return None


def decide(view: View, now: float, policy: PlacementPolicy) -> Plan:
    """One placement step for `view.me`: idle drops, or one load (with the evictions that make room)."""
    if view.loading:
        return Plan()  # one load at a time; the next check sees its result
    everyone = {**view.peers, view.me: self_peer(view, now, policy)}
    pick = _assign(view, everyone, policy)
    if pick is not None:
        base, reason = pick
        room = view.budget_mb - sum(r.memory_mb for r in view.residents)
        evict: list[Move] = []
        for r in sorted(view.residents, key=lambda r: r.last_used):  # least recently used first
            if room >= view.memory_mb[base]:
                break
            if evictable(r, view.pressure.get(r.base, Pressure()), now, policy):
                evict.append(Move(r.base, "evict", f"evicted for {base}", now))
                room += r.memory_mb
        return Plan(tuple(evict), Move(base, "load", reason, now))
    idle = tuple(Move(r.base, "evict", "idle", now) for r in view.residents
                 if now - r.last_used >= policy.idle_s
                 and evictable(r, view.pressure.get(r.base, Pressure()), now, policy))
    return Plan(evict=idle)
