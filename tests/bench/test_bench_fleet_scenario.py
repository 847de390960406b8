"""The agent benchmark's scenario files and their pure parts: trace, loads, hindsight splits, clear errors."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from lorafleet.bench import fleet_scenario as fs


def _scenario(**over: object) -> fs.Scenario:
    data = yaml.safe_load(fs.default_files()[0].read_text())
    data.update(over)
    return fs.Scenario.model_validate(data)


def test_every_shipped_scenario_loads_and_names_only_its_own_models() -> None:
    files = fs.default_files()
    assert files, "bench/scenarios/ holds no scenario"
    for f in files:
        sc = fs.load(f)
        assert sc.capacity_docs_per_s() > 0 and len(sc.models) >= 3


def test_the_same_seed_gives_the_same_trace_and_the_phases_shift_the_mix() -> None:
    sc = _scenario()
    a, b = fs.trace(sc, 4.0, seed=7), fs.trace(sc, 4.0, seed=7)
    assert a == b and a != fs.trace(sc, 4.0, seed=8)
    assert all(x.t < y.t for x, y in itertools.pairwise(a)) and a[-1].t < sc.seconds
    drafting = [x for x in a if x.doc == "drafting"]
    assert drafting and all(sc.phases[0].seconds <= x.t < sc.phases[0].seconds + sc.phases[1].seconds
                            for x in drafting)
    assert 0.7 * 4.0 * sc.seconds < len(a) < 1.3 * 4.0 * sc.seconds  # the mean rate holds through the bursts


def test_dedicated_needs_a_replica_per_model_and_splits_the_rest_by_load() -> None:
    sc = _scenario()
    assert fs.dedicated_split(sc, len(sc.models) - 1) is None
    split = fs.dedicated_split(sc, 14)
    assert split is not None and sum(split.values()) == 14 and min(split.values()) == 1
    load = sc.load_ms_per_doc()
    heaviest, lightest = max(load, key=load.__getitem__), min(load, key=load.__getitem__)
    assert split[heaviest] > split[lightest]


def test_router_packing_respects_memory_and_holds_every_model() -> None:
    sc = _scenario()
    for n in (3, 6, 9):
        held = fs.router_packing(sc, n)
        assert held is not None and len(held) == n
        assert {m for h in held for m in h} == set(sc.models)
        for h in held:
            assert len(set(h)) == len(h) and sum(sc.models[m].memory_mb for m in h) <= sc.worker_memory_mb


def test_bad_scenarios_say_what_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not among models"):
        _scenario(documents={"d": [{"nope": 1}]})
    with pytest.raises(ValueError, match="exceed worker_memory_mb"):
        _scenario(worker_memory_mb=100)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nslo_ms: -1\n")
    with pytest.raises(SystemExit, match=r"bad\.yaml"):
        fs.load(bad)
