"""The holdings state machine, and three workers placing four bases by the same decision over shifting traffic."""

from __future__ import annotations

import pytest

from lorafleet.sidecar import holdings as hs
from lorafleet.sidecar.placement import Move, PlacementPolicy, Pressure, decide

POLICY = PlacementPolicy(wait_s=1.0, idle_s=30.0, min_residency_s=5.0, busy_load=0.8)
MEM = {"embed": 300, "rerank": 300, "gen": 600, "headings": 600}


def test_pins_never_move_and_each_change_records_why() -> None:
    h = hs.pinned(1000, ["embed"], MEM, now=0.0)
    assert h.last_move["embed"].reason == "pinned"
    with pytest.raises(ValueError, match="pinned"):
        hs.evicted(h, Move("embed", "evict", "idle", 1.0))
    h = hs.start_loading(h, Move("gen", "load", "cold", 1.0))
    with pytest.raises(ValueError, match="loading 'gen'"):
        hs.start_loading(h, Move("rerank", "load", "cold", 1.0))
    h = hs.loaded(h, "gen", 610, now=3.0)
    assert h.held == {"embed", "gen"} and h.used_mb == 910 and h.loading is None
    h = hs.evicted(hs.used(h, "gen", 4.0, 0), Move("gen", "evict", "evicted for rerank", 9.0))
    assert h.held == {"embed"} and h.last_move["gen"].reason == "evicted for rerank"
    h = hs.load_failed(hs.start_loading(h, Move("rerank", "load", "cold", 10.0)), "rerank", 11.0, "out of memory")
    assert h.loading is None and h.last_move["rerank"].reason == "load failed: out of memory"


def _step(workers: dict[str, hs.Holdings], pressure: dict[str, Pressure], now: float) -> list[Move]:
    """Every worker decides on the same view (heartbeats of the others), then applies its plan; loads finish."""
    peers = {w: hs.as_peer(h, w, MEM, pressure, 0.0, now, POLICY) for w, h in workers.items()}
    moves: list[Move] = []
    for w, h in list(workers.items()):
        plan = decide(hs.view_of(h, w, MEM, pressure, peers, 0.0), now, POLICY)
        for m in plan.evict:
            h = hs.evicted(h, m)
        if plan.load is not None:
            h = hs.loaded(hs.start_loading(h, plan.load), plan.load.base, MEM[plan.load.base], now)
        moves += [*plan.evict, *([plan.load] if plan.load else [])]
        workers[w] = h
    return moves


def test_three_workers_follow_a_shift_without_double_loads_or_thrash() -> None:
    workers = {w: hs.Holdings(budget_mb=900) for w in ("w1", "w2", "w3")}
    phase1 = {"embed": Pressure(waiting=5, oldest_wait_s=0.2), "rerank": Pressure(waiting=2, oldest_wait_s=0.1),
              "gen": Pressure(), "headings": Pressure()}
    moves = _step(workers, phase1, now=0.0)
    assert sorted(m.base for m in moves if m.action == "load") == ["embed", "rerank"]  # one holder each, cold
    assert _step(workers, phase1, now=1.0) == []  # holders are free: nobody else loads them

    gen_heavy = {**phase1, "embed": Pressure(), "rerank": Pressure(), "gen": Pressure(waiting=20, oldest_wait_s=0.1)}
    moves = _step(workers, gen_heavy, now=2.0)
    assert [(m.base, m.reason) for m in moves] == [("gen", "cold")]
    holder = next(w for w, h in workers.items() if "gen" in h.held)
    assert not ({"embed", "rerank"} & workers[holder].held)  # it went to the worker holding nothing

    for t in (3.0, 4.0, 10.0, 20.0):  # no pressure change, short of idle_s: nothing moves
        assert _step(workers, gen_heavy, now=t) == []
    after_idle = {b: Pressure() for b in MEM}
    moves = _step(workers, after_idle, now=40.0)
    assert sorted((m.base, m.reason) for m in moves) == [("embed", "idle"), ("gen", "idle"), ("rerank", "idle")]
    assert all(not h.held for h in workers.values())  # scale-to-zero per base within the fleet
