"""`promote --shadow / --finish / --abort` (issue 25, part 5): the pure parts (agreement metrics, the sampling, the
shedding rule, the figures and their wire form, the state transitions, the watch's empty-answer rule, the split
consistency check) without servers, then start/abort/finish and the bad inputs against a real nats-server and a
real MLflow store, and `registry check --repair` dropping a shadow whose candidate is gone."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from pathlib import Path

import pytest
from registry_kit import entries, write_fleet_file
from typer.testing import CliRunner

from lorafleet.cli import app
from lorafleet.core.agreement import (
    GatewayShadowStats,
    ShadowFigures,
    chrf,
    exact_match,
    mirror_now,
    rank_overlap,
    summed,
)
from lorafleet.core.fleet_state import CanaryInProgress, FleetEntry, ShadowSpec
from lorafleet.core.heartbeats import STATS_BUCKETS, GatewayStats, VersionCounts, bucket_index
from lorafleet.registry import canary as can
from lorafleet.registry import promote as prom
from lorafleet.registry import shadow as sh
from lorafleet.registry import store
from lorafleet.registry.watch import Margins, judge
from lorafleet.serve.shadow import Rate, should_shed

# -- pure: agreement --------------------------------------------------------------------------------------------


def test_chrf_matches_its_definition_on_small_cases() -> None:
    assert chrf("the cat", "the cat") == pytest.approx(100.0)
    assert chrf("", "") == 100.0
    assert chrf("", "abc") == 0.0 and chrf("abc", "") == 0.0
    assert chrf("xyz", "abc") == 0.0
    # "ab" vs "abc": 1-grams P=1 R=2/3, 2-grams P=1 R=1/2; orders 3..6 do not count (no 3-gram in "ab")
    p, r = (1 + 1) / 2, (2 / 3 + 1 / 2) / 2
    assert chrf("ab", "abc") == pytest.approx(100 * 5 * p * r / (4 * p + r))
    assert chrf("a b", "ab") == pytest.approx(100.0)  # whitespace does not count, as in sacrebleu
    close, far = chrf("the cat sat", "the cat sits"), chrf("a dog ran", "the cat sits")
    assert 0 < far < close < 100


@pytest.mark.parametrize(("hyp", "ref"), [("ab", "abc"), ("the cat sat", "the cat sits"), ("abc", "ab"),
                                          ("a dog ran", "the cat sits"), ("Kündigung der Miete", "Die Kündigung"),
                                          ("x", "abcdefgh")])
def test_chrf_equals_sacrebleu_sentence_chrf(hyp: str, ref: str) -> None:
    from sacrebleu.metrics import CHRF

    assert chrf(hyp, ref) == pytest.approx(CHRF().sentence_score(hyp, [ref]).score, abs=1e-9)


def test_exact_match_and_rank_overlap() -> None:
    assert exact_match(" yes\n", "yes") and not exact_match("yes", "Yes")
    assert rank_overlap([0, 1, 2], [0, 1, 2]) == 1.0
    assert rank_overlap([0, 1, 2, 3], [3, 2, 1, 0], k=2) == 0.0
    assert rank_overlap([0, 1, 2, 3], [1, 0, 3, 2], k=2) == 1.0
    assert rank_overlap([0, 1, 2, 3], [0, 2, 1, 3], k=2) == 0.5
    assert rank_overlap([], []) == 1.0


@pytest.mark.parametrize("percent", [1, 10, 33.3, 50, 99])
def test_mirror_now_takes_exactly_the_share_spread_evenly(percent: float) -> None:
    picks = [mirror_now(i, percent) for i in range(1000)]
    assert sum(picks) == int(1000 * percent / 100)
    if percent <= 50:  # never two in a row: no burst of copies
        assert not any(a and b for a, b in itertools.pairwise(picks))
    for n in (10, 100, 333):  # the share holds from the first requests on
        assert abs(sum(picks[:n]) - n * percent / 100) <= 1


def test_should_shed_sheds_on_a_forming_queue_or_the_in_flight_cap() -> None:
    assert not should_shed(backlog=0, shadow_inflight=0, live_workers=1)
    assert not should_shed(backlog=2, shadow_inflight=1, live_workers=1)  # one champion task per worker: fine
    assert should_shed(backlog=3, shadow_inflight=1, live_workers=1)  # two champion tasks for one worker: a queue
    assert not should_shed(backlog=3, shadow_inflight=1, live_workers=2)
    assert should_shed(backlog=4, shadow_inflight=4, live_workers=8)  # the cap
    assert should_shed(backlog=2, shadow_inflight=0, live_workers=0)  # no worker heard yet counts as one
    # the workers' time: copies only while this gateway's tasks take at most half of what they complete
    assert not should_shed(0, 0, 1, arrival_per_s=4.0, service_per_s=10.0)
    assert should_shed(0, 0, 1, arrival_per_s=6.0, service_per_s=10.0)
    assert not should_shed(0, 0, 1, arrival_per_s=6.0, service_per_s=None)  # not measured yet: the backlog rules


def test_rate_of_a_growing_counter() -> None:
    r = Rate(window_s=2.0)
    assert r.per_s(0, 100.0) is None  # one sample: no rate yet
    assert r.per_s(5, 101.0) == pytest.approx(5.0)
    assert r.per_s(10, 102.0) == pytest.approx(5.0)
    assert r.per_s(10, 110.0) == pytest.approx(0.0)  # idle since: the window forgets the burst


def test_figures_add_compare_and_become_online_metrics() -> None:
    f = ShadowFigures(eligible=4, mirrored=2, shed=1, errors=0)
    f = f.compare(0.010, 0.020, 10, 12, True, chrf_score=100.0)
    f = f.compare(0.010, 0.040, 10, 0, False, chrf_score=0.0)
    m = f.online_metrics()
    assert m["online_shadow_compared"] == 2 and m["online_exact_match"] == 0.5 and m["online_chrf"] == 50.0
    assert m["online_latency_ratio"] == pytest.approx(3.0)
    assert m["online_length_ratio"] == pytest.approx(12 / 20)
    assert m["online_p99_ms_candidate"] == 1000 * STATS_BUCKETS[bucket_index(0.040)]
    assert "online_rank_overlap" not in m
    r = ShadowFigures().compare(0.01, 0.01, 5, 5, False, overlap=0.6)
    assert r.online_metrics()["online_rank_overlap"] == pytest.approx(0.6)
    assert "online_chrf" not in r.online_metrics()
    total = f + r
    assert total.compared == 3 and total.overlaps == 1 and sum(total.champion_buckets) == 3


def test_shadow_figures_round_trip_and_sum_over_gateways() -> None:
    key = ("headings", "1", "2", 1700000000.5)
    other = ("headings", "1", "2", 1800000000.0)  # a later shadow of the same versions: counted apart
    a = ShadowFigures(eligible=3, mirrored=2).compare(0.01, 0.02, 5, 6, True, chrf_score=100.0)
    b = ShadowFigures(eligible=1, mirrored=1, errors=1)
    one = GatewayShadowStats("gw-1", {key: a, other: b})
    back = GatewayShadowStats.from_wire(one.to_wire())
    assert back.shadows == one.shadows and back.gateway == "gw-1"
    latest = {"gw-1": back, "gw-2": GatewayShadowStats("gw-2", {key: b})}
    assert summed(latest, key) == a + b
    assert summed(latest, ("headings", "1", "3", 0.0)) == ShadowFigures()


# -- pure: the watch's empty answers, the stats' wire form ----------------------------------------------------

def _counts(requests: int, empty: int, errors: int = 0) -> VersionCounts:
    buckets = [0] * (len(STATS_BUCKETS) + 1)
    buckets[bucket_index(0.01)] = requests
    return VersionCounts(requests, errors, tuple(buckets), empty)


def test_watch_fails_a_candidate_with_more_empty_answers() -> None:
    m = Margins(min_requests=10, max_empty_increase=0.05)
    v = judge(_counts(100, 1), _counts(50, 10), m)
    assert v.decision == "fail" and "empty answers 20.00 %" in v.reason and "(10 of 50)" in v.reason
    ok = judge(_counts(100, 2), _counts(50, 2), m)
    assert ok.decision == "pass" and "empty answers" in ok.reason
    assert "empty" not in judge(_counts(100, 0), _counts(50, 0), m).reason  # embeddings: nothing to say
    with pytest.raises(can.CanaryError, match="max-empty-increase"):
        Margins(max_empty_increase=1.5)


def test_version_counts_carry_empty_answers_and_read_older_gateways() -> None:
    stats = GatewayStats("gw", {("n", "1"): _counts(5, 2)})
    assert GatewayStats.from_wire(stats.to_wire()).versions[("n", "1")].empty == 2
    from lorafleet.core.wire import pack

    old = pack({"v": 1, "gateway": "gw", "ts": 1.0,
                "versions": [["n", "1", 5, 0, [0] * (len(STATS_BUCKETS) + 1)]]})  # before empty counts
    assert GatewayStats.from_wire(old).versions[("n", "1")].empty == 0
    assert _counts(5, 2).lower_than(_counts(5, 3))  # a gateway restart shows in the empty count too


def test_gateway_metrics_count_empty_answers_per_version() -> None:
    from lorafleet.serve.metrics import GatewayMetrics

    m = GatewayMetrics(lambda: 0.0)
    m.request_done("chat", "h", 200, 0.01, "1", 5, empty=True)
    m.request_done("chat", "h", 200, 0.01, "1", 5)
    m.request_done("chat", "h", 500, 0.01, "1")
    stats = m.version_stats("gw")
    assert stats is not None
    c = stats.versions[("h", "1")]
    assert (c.requests, c.errors, c.empty, sum(c.buckets)) == (3, 1, 1, 3)
    assert c.empty_rate == 0.5


# -- pure: transitions and consistency --------------------------------------------------------------------------

def test_shadow_state_transitions() -> None:
    none = sh.ShadowState("h", None)
    with pytest.raises(sh.ShadowError, match="not served yet"):
        none.start("2")
    served = sh.ShadowState("h", "1")
    running = served.start("2")
    assert running == sh.ShadowState("h", "1", "2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        running.shadow = "3"  # type: ignore[misc]
    with pytest.raises(sh.ShadowError, match="already in progress"):
        running.start("3")
    with pytest.raises(sh.ShadowError, match="canary of h is in progress"):
        sh.ShadowState("h", "1", canary="2").start("3")
    with pytest.raises(sh.ShadowError, match="already the champion"):
        served.start("1")
    assert running.end() == served
    with pytest.raises(sh.ShadowError, match="no shadow in progress"):
        served.end()


@pytest.mark.parametrize("bad", [0, 100, 150, -1, float("nan")])
def test_shadow_share_outside_0_100_is_refused(bad: float) -> None:
    with pytest.raises(sh.ShadowError, match="more than 0 and less than 100"):
        sh.check_share(bad)


def test_shadow_refuses_embedding_bundles() -> None:
    assert sh.check_kind("h", "2", "causal-lm") == "generative"
    assert sh.check_kind("r", "2", "cross-encoder") == "rerank"
    for kind in ("sentence-transformers", None):
        with pytest.raises(sh.ShadowError, match="generative and rerank models only"):
            sh.check_kind("legal", "2", kind)


def _entry(shadow: str | None = "2", adapter: str | None = None) -> FleetEntry:
    spec = None
    if shadow is not None:
        spec = ShadowSpec(version=shadow, percent=50, base="b", adapter_id=adapter or f"h@v{shadow}",
                          adapter_uri=f"models:/h/{shadow}")
    return FleetEntry(name="h", base="b", adapter_id="h@v1", adapter_uri="models:/h/1", version="1",
                      registered_model="h", shadow=spec)


def test_split_problem_names_an_inconsistent_candidate() -> None:
    assert sh.split_problem(_entry(), {"1", "2"}, "1") is None
    assert "no longer in the registry" in (sh.split_problem(_entry(), {"1"}, "1") or "")
    assert "is the champion now" in (sh.split_problem(_entry(), {"1", "2"}, "2") or "")
    assert "not v2's" in (sh.split_problem(_entry(adapter="h@v9"), {"1", "2"}, "1") or "")
    assert sh.split_problem(_entry(None), set(), None) is None


def test_a_shadow_holds_the_name_and_reaches_workers() -> None:
    from lorafleet.core.fleet_state import by_adapter_id, refuse_during_canary

    e = _entry()
    with pytest.raises(CanaryInProgress, match="shadow of h is in progress"):
        refuse_during_canary(e)
    assert by_adapter_id([e])["h@v2"].adapter == "models:/h/2"  # workers resolve the copies' adapter
    assert FleetEntry.from_bytes(e.to_bytes()) == e
    assert b"shadow" not in _entry(None).to_bytes()  # readable by older processes when there is none


def test_cli_bad_flags_change_nothing() -> None:
    runner = CliRunner()
    for args, says in ((["--shadow", "0"], "more than 0 and less than 100"),
                       (["--shadow", "100"], "more than 0 and less than 100"),
                       (["--shadow", "10", "--canary", "10"], "do not go together"),
                       (["--shadow", "10", "--abort"], "do not go together"),
                       (["--shadow", "10", "--watch", "5m"], "--watch judges a canary")):
        res = runner.invoke(app, ["promote", "headings", *args, "--nats-url", "nats://127.0.0.1:1"])
        assert res.exit_code == 1 and says in res.output, (args, res.output)


# -- a real nats-server and MLflow -------------------------------------------------------------------------------


@pytest.fixture
def fleet_file(tmp_path: Path) -> Path:
    return write_fleet_file(tmp_path / "fleet.yaml")


def _register(name: str, adapter: Path, base_source: Path, score: float, kind: str) -> str:
    return store.register_bundle(name, adapter, base_source=str(base_source), base_name="tiny", kind=kind,
                                 metrics={"test_ndcg@10": score, "base_test_ndcg@10": 0.30}).version


@pytest.mark.integration
def test_shadow_start_abort_finish_and_what_it_refuses(nats_server, fleet_file: Path, tiny_adapter: Path,
                                                       tiny_model_dir: Path) -> None:
    url = nats_server.url
    asyncio.run(entries(url, create=True))
    for score in (0.40, 0.45, 0.46):
        _register("rr", tiny_adapter, tiny_model_dir, score, "cross-encoder")
    _register("emb", tiny_adapter, tiny_model_dir, 0.40, "sentence-transformers")
    _register("emb", tiny_adapter, tiny_model_dir, 0.45, "sentence-transformers")
    kw = {"nats_url": url, "fleet_file": fleet_file}
    runner = CliRunner()
    cli = ["--nats-url", url, "--fleet", str(fleet_file)]
    prom.promote("emb", "1", **kw)
    res = runner.invoke(app, ["promote", "emb", "--version", "2", "--shadow", "50", *cli])
    assert res.exit_code == 1 and "generative and rerank models only" in res.output, res.output
    assert asyncio.run(entries(url))["emb"].shadow is None
    with pytest.raises(sh.ShadowError, match="not served yet"):
        sh.start("rr", "2", 50, **kw)
    prom.promote("rr", "1", **kw)
    res = runner.invoke(app, ["promote", "rr", "--abort", *cli])
    assert res.exit_code == 1 and "no canary or shadow in progress" in res.output, res.output
    res = runner.invoke(app, ["promote", "rr", "--finish", *cli])
    assert res.exit_code == 1 and "no canary or shadow in progress" in res.output, res.output

    res = runner.invoke(app, ["promote", "rr", "--version", "2", "--shadow", "50", *cli])
    assert res.exit_code == 0 and "shadow v2 gets copies of 50 %" in res.output, res.output
    entry = asyncio.run(entries(url))["rr"]
    assert (entry.version, entry.shadow.version, entry.shadow.percent, entry.canary) == ("1", "2", 50.0, None)
    # While it runs: a promote, a second shadow and a canary are refused, nothing changed.
    with pytest.raises(CanaryInProgress, match="shadow of rr is in progress"):
        prom.promote("rr", "3", **kw)
    with pytest.raises(sh.ShadowError, match="already in progress"):
        sh.start("rr", "3", 10, **kw)
    with pytest.raises(can.CanaryError, match="shadow of rr is in progress"):
        can.start("rr", "3", 10, **kw)
    assert asyncio.run(entries(url))["rr"] == entry

    out = sh.abort("rr", listen_s=0.2, **kw)  # no gateway: empty figures, logged all the same
    after = asyncio.run(entries(url))["rr"]
    assert out.shadow is None and after.shadow is None and after.version == "1" and "2" not in after.retired
    assert store.alias_version("rr", "champion") == "1"
    run = store.client().get_run(store.client().get_model_version("rr", "2").run_id)
    assert run.data.metrics["online_shadow_compared"] == 0.0 and sh.ONLINE_TAG in run.data.tags

    sh.start("rr", "3", 25, **kw)
    done, _figures, run_id = sh.finish("rr", listen_s=0.2, **kw)
    final = asyncio.run(entries(url))["rr"]
    assert (done.version, done.previous, final.version, final.shadow) == ("3", "1", "3", None)
    assert [r.version for r in final.retained] == ["1"] and run_id is not None
    assert store.alias_version("rr", "champion") == "3"


@pytest.mark.integration
@pytest.mark.parametrize("split", ["canary", "shadow"])
def test_check_repair_drops_a_split_whose_candidate_is_gone(nats_server, fleet_file: Path, tiny_adapter: Path,
                                                           tiny_model_dir: Path, split: str) -> None:
    url = nats_server.url
    asyncio.run(entries(url, create=True))
    for score in (0.40, 0.45):
        _register("rr", tiny_adapter, tiny_model_dir, score, "cross-encoder")
    kw = {"nats_url": url, "fleet_file": fleet_file}
    prom.promote("rr", "1", **kw)
    (sh.start if split == "shadow" else can.start)("rr", "2", 50, **kw)
    store.client().delete_model_version("rr", "2")  # the candidate is gone from the registry
    cli = ["registry", "check", "rr", "--nats-url", url, "--fleet", str(fleet_file)]
    res = CliRunner().invoke(app, cli)
    assert res.exit_code == 1 and "no longer in the registry" in res.output, res.output
    assert getattr(asyncio.run(entries(url))["rr"], split) is not None  # without --repair, nothing changes
    res = CliRunner().invoke(app, [*cli, "--repair"])
    assert res.exit_code == 0 and "dropped the canary/shadow" in res.output, res.output
    entry = asyncio.run(entries(url))["rr"]
    assert entry.shadow is None and entry.canary is None and entry.version == "1"


class _FakeGateway:
    """What ShadowMirror reads of a gateway: its bases, live workers, backlog, service rate, published count."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.backlog = 0
        self.gateway_id = "gw-test"
        self.resolver = SimpleNamespace(bases=("b",))
        self.workers = SimpleNamespace(live_counts=lambda bases: dict.fromkeys(bases, 1),
                                       service_rate=lambda base: None)
        self.monitor = SimpleNamespace(backlog=lambda base: self.backlog)
        self.metrics = SimpleNamespace(published_total={})


def test_the_mirror_samples_plain_champion_answers_and_sheds_on_backlog() -> None:
    from lorafleet.serve.resolver import Route
    from lorafleet.serve.shadow import ShadowMirror

    gw = _FakeGateway()
    mirror = ShadowMirror(gw)  # type: ignore[arg-type]
    entry = _entry()
    mirror.update([entry])
    champion = Route(name="h", base="b", adapter="h@v1", version="1")
    took = [mirror._take(champion, "h") for _ in range(10)]
    assert sum(t is not None for t in took) == 5 and all(t.route.version == "2" for t in took if t is not None)
    assert mirror._take(champion, "h@1") is None  # a pinned request is the client's choice: never copied
    key = sh.shadow_key(entry)
    assert (mirror.figures[key].eligible, mirror.figures[key].mirrored, mirror.figures[key].shed) == (10, 5, 0)
    gw.backlog = 5  # a queue forms: every sampled copy is shed, counted
    for _ in range(10):
        assert mirror._take(champion, "h") is None
    assert (mirror.figures[key].mirrored, mirror.figures[key].shed) == (5, 5)
    mirror.update([_entry(None)])  # the shadow ended: nothing sampled, its figures still published for a while
    assert mirror._take(champion, "h") is None and key in (mirror.stats() or GatewayShadowStats("", {})).shadows
