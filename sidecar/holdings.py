"""What this worker holds: typed state, owned by its placement task, changed only by the functions here.

Every change returns a new `Holdings` (frozen), so the heartbeat, `lorafleet status` and the decision
read one consistent snapshot; the last move per base, with its reason, is what operators see.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from lorafleet.sidecar.placement import Move, Peer, PlacementPolicy, Pressure, Resident, View, self_peer


@dataclass(frozen=True)
class Holdings:
    budget_mb: int
    residents: tuple[Resident, ...] = ()
    loading: str | None = None
    last_move: Mapping[str, Move] = field(default_factory=dict)  # per base: the last load/evict and why

    @property
    def held(self) -> frozenset[str]:
        return frozenset(r.base for r in self.residents)

    @property
    def used_mb(self) -> int:
        return sum(r.memory_mb for r in self.residents)

    def resident(self, base: str) -> Resident | None:
        return next((r for r in self.residents if r.base == base), None)


def pinned(budget_mb: int, bases: Iterable[str], memory_mb: Mapping[str, int], now: float) -> Holdings:
    """A worker's start: its `--base` pins, held for good."""
    rs = tuple(Resident(b, memory_mb[b], now, now, pinned=True) for b in bases)
    return Holdings(budget_mb, rs, None, {b: Move(b, "load", "pinned", now) for b in bases})


def start_loading(h: Holdings, move: Move) -> Holdings:
    if h.loading is not None or move.base in h.held:
        raise ValueError(f"cannot load {move.base!r}: loading {h.loading!r}, holding {sorted(h.held)}")
    return replace(h, loading=move.base, last_move={**h.last_move, move.base: move})


def loaded(h: Holdings, base: str, memory_mb: int, now: float) -> Holdings:
    """The load finished; `memory_mb` is what it measured (or what the base declares)."""
    if h.loading != base:
        raise ValueError(f"{base!r} finished loading but {h.loading!r} was loading")
    return replace(h, residents=(*h.residents, Resident(base, memory_mb, now, now)), loading=None)


def load_failed(h: Holdings, base: str, now: float, error: str) -> Holdings:
    return replace(h, loading=None, last_move={**h.last_move, base: Move(base, "evict", f"load failed: {error}", now)})


def evicted(h: Holdings, move: Move) -> Holdings:
    r = h.resident(move.base)
    if r is None or r.pinned:
        raise ValueError(f"cannot evict {move.base!r}: {'pinned' if r else 'not held'}")
    return replace(h, residents=tuple(x for x in h.residents if x.base != move.base),
                   last_move={**h.last_move, move.base: move})


def used(h: Holdings, base: str, now: float, in_flight: int) -> Holdings:
    """A batch of `base` started or settled: its recency and the work it has in flight."""
    return replace(h, residents=tuple(replace(r, last_used=now, in_flight=in_flight) if r.base == base else r
                                      for r in h.residents))


def view_of(h: Holdings, me: str, memory_mb: Mapping[str, int], pressure: Mapping[str, Pressure],
            peers: Mapping[str, Peer], load: float) -> View:
    return View(me, h.budget_mb, h.residents, memory_mb, pressure, {k: v for k, v in peers.items() if k != me},
                load, h.loading)


def as_peer(h: Holdings, me: str, memory_mb: Mapping[str, int], pressure: Mapping[str, Pressure], load: float,
            now: float, policy: PlacementPolicy) -> Peer:
    """This worker as its heartbeat announces it."""
    return self_peer(view_of(h, me, memory_mb, pressure, {}, load), now, policy)
