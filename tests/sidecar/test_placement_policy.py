"""The placement decision, a pure function: every case named in the design, no servers."""

from __future__ import annotations

from lorafleet.sidecar.placement import Peer, PlacementPolicy, Pressure, Resident, View, decide, holdable

POLICY = PlacementPolicy(wait_s=1.0, idle_s=60.0, min_residency_s=10.0, busy_load=0.8)
NOW = 1000.0
MEM = {"a": 400, "b": 400, "c": 400, "big": 5000}


def view(me: str = "w1", residents: tuple[Resident, ...] = (), budget: int = 1000,
         pressure: dict[str, Pressure] | None = None, peers: dict[str, Peer] | None = None,
         load: float = 0.0, loading: str | None = None) -> View:
    return View(me, budget, residents, MEM, pressure or {}, peers or {}, load, loading)


def old(base: str, *, used: float = NOW - 100, pinned: bool = False, in_flight: int = 0) -> Resident:
    return Resident(base, MEM[base], loaded_at=NOW - 500, last_used=used, in_flight=in_flight, pinned=pinned)


def test_a_base_nobody_holds_is_loaded_at_once_by_the_one_best_placed_worker() -> None:
    p = {"a": Pressure(waiting=1, oldest_wait_s=0.01)}
    w2 = Peer("w2", 1000, 0, frozenset())
    plan1 = decide(view("w1", pressure=p, peers={"w2": w2}), NOW, POLICY)
    plan2 = decide(view("w2", pressure=p, peers={"w1": Peer("w1", 1000, 0, frozenset())}), NOW, POLICY)
    loads = [pl.load for pl in (plan1, plan2) if pl.load]
    assert len(loads) == 1 and loads[0].base == "a" and loads[0].reason == "cold"


def test_a_waiting_base_whose_holder_is_free_gains_no_second_holder() -> None:
    p = {"a": Pressure(waiting=3, oldest_wait_s=5.0)}
    holder = Peer("w2", 1000, 400, frozenset({"a"}), load=0.3)
    assert decide(view(pressure=p, peers={"w2": holder}), NOW, POLICY).empty


def test_a_base_waiting_past_the_threshold_on_busy_holders_is_loaded_by_an_idle_worker() -> None:
    busy = Peer("w2", 1000, 400, frozenset({"a"}), load=0.95)
    young = {"a": Pressure(waiting=3, oldest_wait_s=0.5)}
    assert decide(view(pressure=young, peers={"w2": busy}), NOW, POLICY).empty  # hysteresis: not yet
    aged = {"a": Pressure(waiting=3, oldest_wait_s=1.5)}
    plan = decide(view(pressure=aged, peers={"w2": busy}), NOW, POLICY)
    assert plan.load is not None and (plan.load.base, plan.load.reason) == ("a", "pressure")


def test_a_load_evicts_the_least_recently_used_idle_base_and_says_for_whom() -> None:
    mine = (old("b", used=NOW - 30), old("c", used=NOW - 50))
    plan = decide(view(residents=mine, pressure={"a": Pressure(waiting=1)}), NOW, POLICY)
    assert plan.load is not None and plan.load.base == "a"
    assert [(m.base, m.reason) for m in plan.evict] == [("c", "evicted for a")]


def test_pinned_busy_or_young_bases_are_never_evicted() -> None:
    pinned = old("b", pinned=True)
    busy = old("c", in_flight=2)
    young = Resident("b", 400, loaded_at=NOW - 1, last_used=NOW - 1)
    for mine in ((pinned, busy), (young, busy)):
        plan = decide(view(residents=mine, pressure={"a": Pressure(waiting=1)}), NOW, POLICY)
        assert plan.empty, plan  # it cannot make room, so it does not load either


def test_a_base_with_waiting_tasks_is_not_evicted_to_make_room() -> None:
    mine = (old("b"), old("c"))
    p = {"a": Pressure(waiting=1), "b": Pressure(waiting=2, oldest_wait_s=0.1), "c": Pressure(in_flight=1)}
    assert decide(view(residents=mine, pressure=p), NOW, POLICY).empty


def test_an_unused_base_is_dropped_after_idle_s_and_a_recent_one_is_kept() -> None:
    mine = (old("b", used=NOW - 61), old("c", used=NOW - 59))
    plan = decide(view(residents=mine), NOW, POLICY)
    assert plan.load is None and [(m.base, m.reason) for m in plan.evict] == [("b", "idle")]
    assert decide(view(residents=(old("b", used=NOW - 61, pinned=True),)), NOW, POLICY).empty


def test_two_waiting_bases_go_to_two_different_workers() -> None:
    p = {"a": Pressure(waiting=1, oldest_wait_s=3.0), "b": Pressure(waiting=1, oldest_wait_s=2.0)}
    peers = {"w1": Peer("w1", 1000, 0, frozenset()), "w2": Peer("w2", 1000, 0, frozenset())}
    picks = {}
    for me in ("w1", "w2"):
        others = {k: v for k, v in peers.items() if k != me}
        plan = decide(view(me, pressure=p, peers=others), NOW, POLICY)
        assert plan.load is not None
        picks[me] = plan.load.base
    assert sorted(picks.values()) == ["a", "b"]


def test_one_load_at_a_time_and_a_base_beyond_every_budget_is_not_holdable() -> None:
    assert decide(view(pressure={"a": Pressure(waiting=1)}, loading="b"), NOW, POLICY).empty
    assert decide(view(pressure={"big": Pressure(waiting=1)}), NOW, POLICY).empty
    assert not holdable(MEM["big"], [1000, 2000]) and holdable(MEM["a"], [300, 1000])
