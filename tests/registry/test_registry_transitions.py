"""Promotion as a state machine over three stores (issue 38): the champion alias and its history (a real MLflow
store), the live fleet entry (a real nats-server's KV bucket), and what gateways route by (that entry).

The interruption matrix: every write of promote, rollback, canary start/finish/abort, shadow start/finish/abort
and repair is interrupted right after it (registry/writes.py's hook), either as a process that dies there (no
undo can run: `kill`) or as Ctrl-C (the undo runs). After a kill each follow-up command runs (promote, rollback,
--abort, --finish, `registry check --repair`), then a repair; after every step:

- an aborted or retired version is never served to more traffic than when it was first seen taken out;
- `check` reports a disagreement exactly when the stores disagree;
- the repair converges to the state the follow-up reported as done (or, if it was refused, to the state before
  or after the interrupted command).

Also the single defects of items 1, 3, 4 and 5, and the watch's connection settings (item 9). One nats-server,
one MLflow store and one set of registered versions serve the whole module; each case restores its start state.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lorafleet.core.config import BaseModelSpec, FleetConfig, WorkerConfig
from lorafleet.core.fleet_state import FleetEntry, FleetStateError, ensure_fleet_bucket
from lorafleet.core.heartbeats import STATS_BUCKETS, GatewayStats, VersionCounts, bucket_index, stats_subject
from lorafleet.registry import canary as can
from lorafleet.registry import promote as prom
from lorafleet.registry import shadow as sh
from lorafleet.registry import store, watch
from lorafleet.registry.lock import LockRecord, lock_key
from lorafleet.registry.store import RegistryError
from lorafleet.registry.writes import Killed, hooked, interrupted_after

pytestmark = pytest.mark.integration

NAME, RR = "legal", "rr"  # an embedding name (canaries) and a rerank name (shadows)
BUCKET = "lorafleet_fleet"
WAIT_S = 30.0
NO_PRELOAD = prom.Preload(enabled=False)
Summary = tuple[str | None, str | None, str | None, str | None]  # alias, served, canary, shadow


# -- the module's cluster and registry ---------------------------------------------------------------------------

async def _kv(url: str) -> tuple[Any, Any]:
    import nats

    nc = await nats.connect(url)
    return nc, await ensure_fleet_bucket(nc.jetstream())


def off_loop(coro: Any) -> Any:
    """asyncio.run in a thread of its own: callable from a hook or callback running on a command's loop."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(asyncio.run(coro))
        except BaseException as exc:
            out.append(exc)
    t = threading.Thread(target=target)
    t.start()
    t.join(WAIT_S)
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def kv_do(url: str, fn: Callable[[Any], Any]) -> Any:
    """Run `fn(kv)` (a coroutine function) on a connection of its own."""
    async def run() -> Any:
        nc, kv = await _kv(url)
        try:
            return await fn(kv)
        finally:
            await nc.close()
    return off_loop(run())


@dataclass(frozen=True)
class Stores:
    """What the three stores say about one name."""

    alias: str | None
    history: tuple[str, ...]
    raw: bytes | None  # the live entry as stored

    @property
    def entry(self) -> FleetEntry | None:
        return FleetEntry.from_bytes(self.raw) if self.raw else None

    def summary(self) -> Summary:
        e = self.entry
        return (self.alias, e.version if e else None, e.canary.version if e and e.canary else None,
                e.shadow.version if e and e.shadow else None)

    def consistent(self) -> bool:
        e = self.entry
        if self.alias is None:
            return True
        splits = {s.version for s in (e.canary, e.shadow) if s is not None} if e else set()
        return e is not None and e.version == self.alias and self.history[-1:] == (self.alias,) \
            and self.alias not in splits

    def share(self, version: str) -> float:
        """The share of the name's traffic `version` answers: champion and canary by percent, a retained former
        champion (pinned requests only) a token amount, a shadow none (clients never see its answers)."""
        e = self.entry
        if e is None:
            return 0.0
        split = e.canary.percent if e.canary else 0.0
        if version == e.version:
            return 100.0 - split
        if e.canary is not None and e.canary.version == version:
            return split
        return 0.001 if any(r.version == version for r in e.retained) else 0.0


@dataclass
class Cluster:
    url: str
    fleet_file: Path
    snaps: dict[tuple[str, str], Stores]

    @property
    def kw(self) -> dict[str, Any]:
        return {"nats_url": self.url, "fleet_file": self.fleet_file}

    def read(self, name: str) -> Stores:
        async def get(kv: Any) -> bytes | None:
            from nats.js.errors import KeyNotFoundError

            try:
                return (await kv.get(name)).value
            except KeyNotFoundError:
                return None
        return Stores(store.alias_version(name, "champion"), tuple(store.champion_history(name)),
                      kv_do(self.url, get))

    def restore(self, name: str, snap: Stores) -> None:
        assert snap.alias is not None and snap.raw is not None
        store.set_alias(name, "champion", snap.alias)
        store.set_champion_history(name, list(snap.history))

        async def put(kv: Any) -> None:
            await kv.put(name, snap.raw)
            from nats.js.errors import KeyNotFoundError

            with pytest.raises(KeyNotFoundError):  # no lock left over by an earlier case
                await kv.get(lock_key(name))
        kv_do(self.url, put)

    def start(self, name: str, which: str) -> Stores:
        snap = self.snaps[(name, which)]
        self.restore(name, snap)
        return snap


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_adapter: Path, tiny_model_dir: Path) -> Iterator[Cluster]:
    from lorafleet.nats.server import NatsServer

    home = tmp_path_factory.mktemp("transitions")
    server = NatsServer(home / "nats").start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAFLEET_HOME", str(home / "home"))
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
        fleet_file = home / "fleet.yaml"
        fleet_file.write_text(FleetConfig(bases=[BaseModelSpec(name="tiny", source="x")],
                                          worker=WorkerConfig(heartbeat_s=0.2)).model_dump_json())
        try:
            kv_do(server.url, lambda kv: asyncio.sleep(0))
            for name, kind in ((NAME, "sentence-transformers"), (RR, "cross-encoder")):
                for score in (0.40, 0.45, 0.46, 0.47):
                    store.register_bundle(name, tiny_adapter, base_source=str(tiny_model_dir), base_name="tiny",
                                          kind=kind, metrics={"test_ndcg@10": score, "base_test_ndcg@10": 0.30})
            c = Cluster(server.url, fleet_file, {})
            kw = {**c.kw, "preload": NO_PRELOAD}
            for name in (NAME, RR):
                prom.promote(name, "1", **kw)
                prom.promote(name, "2", **kw)
                c.snaps[(name, "served")] = c.read(name)  # champion v2, history 1,2, v1 retained
            can.start(NAME, "3", 20, **kw)
            c.snaps[(NAME, "split")] = c.read(NAME)  # canary v3 at 20 %
            sh.start(RR, "3", 20, **kw)
            c.snaps[(RR, "split")] = c.read(RR)  # shadow v3 at 20 %
            served = c.snaps[(NAME, "served")]
            c.snaps[(NAME, "torn")] = Stores("3", served.history, served.raw)  # a promote of v3 died after the alias
            yield c
        finally:
            server.stop()


@pytest.fixture
def fleet(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    monkeypatch.setenv("LORAFLEET_HOME", str(cluster.fleet_file.parent / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{cluster.fleet_file.parent / 'mlflow.db'}")
    return cluster


# -- the commands ------------------------------------------------------------------------------------------------

def repair(c: Cluster, name: str) -> prom.Agreement:
    """What `lorafleet registry check NAME --repair` does."""
    state = prom.check(name, repair=True, **c.kw)
    sh.drop_stale(name, repair=True, **c.kw)
    return state


def reports(c: Cluster, name: str) -> bool:
    """Whether `lorafleet registry check NAME` (no repair) says anything is wrong."""
    return not prom.check(name, **c.kw).agrees or sh.drop_stale(name, repair=False, **c.kw) is not None


def _end(c: Cluster, name: str, finish: bool) -> Summary:
    """`promote NAME --finish/--abort`: a shadow's or a canary's, as the CLI chooses."""
    kw = {**c.kw, "preload": NO_PRELOAD}
    entry = sh.running(name, **c.kw)
    if entry is not None and entry.shadow is not None:
        if finish:
            out, _, _ = sh.finish(name, listen_s=0.05, **kw)
            return out.version, out.version, None, None
        ended = sh.abort(name, listen_s=0.05, **c.kw)
        return ended.champion, ended.champion, None, None
    if finish:
        done = can.finish(name, **kw)
        return done.version, done.version, None, None
    aborted = can.abort(name, **c.kw)
    return aborted.champion, aborted.champion, None, None


def _promote(c: Cluster, name: str) -> Summary:
    prom.promote(name, "4", **c.kw, preload=NO_PRELOAD)
    return "4", "4", None, None


def _rollback(c: Cluster, name: str) -> Summary:
    out = prom.rollback(name, **c.kw, preload=NO_PRELOAD)
    return out.version, out.version, None, None


def _repair(c: Cluster, name: str) -> Summary:
    repair(c, name)
    return c.read(name).summary()


FOLLOW_UPS: dict[str, Callable[[Cluster, str], Summary]] = {
    "promote": _promote, "rollback": _rollback, "abort": lambda c, n: _end(c, n, False),
    "finish": lambda c, n: _end(c, n, True), "repair": _repair}
REFUSED = (prom.PromotionError, FleetStateError, RegistryError)


@dataclass(frozen=True)
class Command:
    """An interrupted command: its name, start state, the writes it makes and the state it reports when done."""

    id: str
    name: str
    start: str
    run: Callable[[Cluster], object]
    steps: tuple[str, ...]
    done: Summary


KW = {"preload": NO_PRELOAD}
COMMANDS = [
    Command("promote", NAME, "served", lambda c: prom.promote(NAME, "3", **c.kw, **KW), ("alias", "history", "fleet"),
            ("3", "3", None, None)),
    Command("rollback", NAME, "served", lambda c: prom.rollback(NAME, **c.kw, **KW), ("alias", "history", "fleet"),
            ("1", "1", None, None)),
    Command("canary-start", NAME, "served", lambda c: can.start(NAME, "3", 20, **c.kw, **KW), ("fleet",),
            ("2", "2", "3", None)),
    Command("canary-finish", NAME, "split", lambda c: can.finish(NAME, **c.kw, **KW), ("alias", "history", "fleet"),
            ("3", "3", None, None)),
    Command("canary-abort", NAME, "split", lambda c: can.abort(NAME, **c.kw), ("fleet",), ("2", "2", None, None)),
    Command("shadow-start", RR, "served", lambda c: sh.start(RR, "3", 20, **c.kw, **KW), ("fleet",),
            ("2", "2", None, "3")),
    Command("shadow-finish", RR, "split", lambda c: sh.finish(RR, listen_s=0.05, **c.kw, **KW),
            ("alias", "history", "fleet"), ("3", "3", None, None)),
    Command("shadow-abort", RR, "split", lambda c: sh.abort(RR, listen_s=0.05, **c.kw), ("fleet",),
            ("2", "2", None, None)),
    Command("repair", NAME, "torn", lambda c: repair(c, NAME), ("fleet", "history"), ("3", "3", None, None)),
]
CASES = [pytest.param(cmd, step, id=f"{cmd.id}-{step}") for cmd in COMMANDS for step in cmd.steps]


class Watcher:
    """Tracks versions seen taken out (retired) and the share each had then: it may never grow afterwards."""

    def __init__(self, name: str, first: Stores, aborting: str | None = None) -> None:
        self.name, self.bounds = name, {}
        if aborting is not None:  # the split an abort takes out: never more than it had
            self.bounds[aborting] = first.share(aborting)
        self.see(first, "start")

    def see(self, now: Stores, when: str) -> None:
        for v, bound in self.bounds.items():
            assert now.share(v) <= bound, f"{when}: taken-out v{v} serves {now.share(v)} % (had {bound}): {now}"
        e = now.entry
        for v in e.retired if e is not None else ():
            self.bounds[v] = min(self.bounds.get(v, math.inf), now.share(v))


def _reports_exactly(c: Cluster, name: str, now: Stores, when: str) -> None:
    assert reports(c, name) == (not now.consistent()), f"{when}: check says {reports(c, name)} for {now}"


@pytest.mark.parametrize(("cmd", "step"), CASES)
def test_a_kill_after_any_write_then_any_follow_up_converges(fleet: Cluster, cmd: Command, step: str) -> None:
    before = fleet.start(cmd.name, cmd.start)
    with interrupted_after(step, kill=True) as seen, pytest.raises(Killed):  # type: ignore[arg-type]
        cmd.run(fleet)
    assert seen[0] == 1
    crashed = fleet.read(cmd.name)
    _reports_exactly(fleet, cmd.name, crashed, f"{cmd.id} killed after {step}")
    for follow, run in FOLLOW_UPS.items():
        when = f"{cmd.id} killed after {step}, then {follow}"
        fleet.restore(cmd.name, crashed)
        taken = Watcher(cmd.name, before, aborting="3" if cmd.id.endswith("abort") else None)
        taken.see(crashed, f"{when}: after the kill")
        try:
            reported: Summary | None = run(fleet, cmd.name)
        except REFUSED:
            reported = None
        after = fleet.read(cmd.name)
        taken.see(after, f"{when}: after the follow-up")
        _reports_exactly(fleet, cmd.name, after, f"{when}: after the follow-up")
        repair(fleet, cmd.name)
        final = fleet.read(cmd.name)
        taken.see(final, f"{when}: after the repair")
        assert final.consistent() and not reports(fleet, cmd.name), f"{when}: {final}"
        allowed = [reported] if reported is not None else [before.summary(), cmd.done]
        assert final.summary() in allowed, f"{when}: {final.summary()} not in {allowed}"


@pytest.mark.parametrize(("cmd", "step"), [p for p in CASES if p.values[0].id != "repair"])
def test_ctrl_c_after_any_write_leaves_the_stores_agreeing(fleet: Cluster, cmd: Command, step: str) -> None:
    """Ctrl-C (or SIGTERM, or a cancellation) is not a dead process: the undo runs, and a final write that was
    stored is kept. Either way the stores agree at once, no repair needed."""
    before = fleet.start(cmd.name, cmd.start)
    with interrupted_after(step) as seen, pytest.raises(KeyboardInterrupt):  # type: ignore[arg-type]
        cmd.run(fleet)
    assert seen[0] >= 1  # the undo writes the same step again
    now = fleet.read(cmd.name)
    assert now.consistent(), now
    assert now.summary() == (cmd.done if step == "fleet" else before.summary())


# -- item 1: an aborted canary never becomes champion ---------------------------------------------------------------

def test_an_aborted_canary_never_becomes_champion_after_a_dead_finish(fleet: Cluster) -> None:
    """The issue's sequence: `--finish` dies right after the alias moved; `--abort`; then promote, rollback and
    `registry check --repair` must not make the aborted v3 champion."""
    fleet.start(NAME, "split")
    with interrupted_after("alias", kill=True), pytest.raises(Killed):
        can.finish(NAME, **fleet.kw, preload=NO_PRELOAD)
    assert fleet.read(NAME).summary() == ("3", "2", "3", None)  # the torn state
    out = can.abort(NAME, **fleet.kw)
    now = fleet.read(NAME)
    assert out.aborted == "3" and now.summary() == ("2", "2", None, None), now
    assert now.history == ("1", "2") and "3" in now.entry.retired  # type: ignore[union-attr]
    assert repair(fleet, NAME).champion == "2"
    assert prom.rollback(NAME, **fleet.kw, preload=NO_PRELOAD).version == "1"
    assert fleet.read(NAME).summary() == ("1", "1", None, None)


def test_a_repair_never_brings_back_a_retired_version(fleet: Cluster) -> None:
    """The stores as an older `--abort` left them (alias still on the aborted v3, the fleet retired it): the
    repair follows the fleet, not the alias."""
    split = fleet.start(NAME, "split")
    entry = split.entry
    assert entry is not None
    ended = entry.model_copy(update={"canary": None, "retired": ["3", *entry.retired]})
    fleet.restore(NAME, Stores("3", ("1", "2", "3"), ended.to_bytes()))
    assert reports(fleet, NAME)
    state = repair(fleet, NAME)
    assert state.repaired and state.champion == "2"
    assert fleet.read(NAME).summary() == ("2", "2", None, None) and fleet.read(NAME).history == ("1", "2")


# -- item 3: a lost ack on the final write --------------------------------------------------------------------------

def test_a_lost_ack_on_the_fleet_write_is_read_back_not_undone(fleet: Cluster) -> None:
    from nats.errors import TimeoutError as NatsTimeout

    fleet.start(NAME, "served")
    with interrupted_after("fleet", exc=NatsTimeout()):  # stored, then the ack "timed out"
        out = prom.promote(NAME, "3", **fleet.kw, preload=NO_PRELOAD)
    assert (out.version, out.previous) == ("3", "2")
    now = fleet.read(NAME)
    assert now.summary() == ("3", "3", None, None) and now.history == ("1", "2", "3"), now


# -- item 4: a lock lost during the slow part ---------------------------------------------------------------------

@pytest.mark.parametrize("gap", ["read", "alias"])
def test_a_promote_that_lost_its_lock_never_writes_or_undoes_over_the_next(fleet: Cluster, gap: str) -> None:
    """Promote A stalls past its lock's TTL right after its last read (or after moving the alias); promote B takes
    the expired lock over and promotes v4. A must write nothing more, and undo nothing: B's result stands."""
    fleet.start(NAME, "served")
    fired = threading.Event()
    b_result: list[object] = []

    def expire_and_run_b() -> None:
        async def expire(kv: Any) -> None:
            got = await kv.get(lock_key(NAME))
            held = LockRecord.from_bytes(got.value)
            assert held is not None
            dead = LockRecord(held.owner, held.action, held.host, held.pid, held.since, time.time() - 1)
            await kv.put(lock_key(NAME), dead.to_bytes())
        kv_do(fleet.url, expire)
        try:
            b_result.append(prom.promote(NAME, "4", **fleet.kw, preload=NO_PRELOAD))
        except BaseException as exc:
            b_result.append(exc)

    def hook(step: str, phase: str) -> None:
        if step == gap and phase == "after" and not fired.is_set():
            fired.set()  # A's stall: B runs to its end meanwhile (its own loop, in a thread)
            b = threading.Thread(target=expire_and_run_b)
            b.start()
            b.join(WAIT_S)

    with hooked(hook), pytest.raises(prom.PromotionError, match="lock of legal"):
        prom.promote(NAME, "3", **fleet.kw, preload=NO_PRELOAD)
    assert fired.is_set() and isinstance(b_result[0], prom.Outcome), b_result
    now = fleet.read(NAME)
    assert now.consistent() and now.summary() == ("4", "4", None, None), now
    assert now.history == (("1", "2", "4") if gap == "read" else ("1", "2", "3", "4")), now


# -- item 5: the watch aborts a failing canary whoever holds the lock for a moment ----------------------------------

def _counts(requests: int, errors: int = 0) -> VersionCounts:
    b = [0] * (len(STATS_BUCKETS) + 1)
    b[bucket_index(0.01)] = requests
    return VersionCounts(requests, errors, tuple(b))


def test_the_watch_aborts_a_failing_canary_once_the_lock_is_released(fleet: Cluster) -> None:
    fleet.start(NAME, "split")
    steps: list[str] = []

    async def publish() -> None:  # a gateway: a baseline, then the canary failing every request
        import nats

        nc = await nats.connect(fleet.url)
        try:
            for stats in (GatewayStats("gw-t", {}), GatewayStats("gw-t", {(NAME, "2"): _counts(50),
                                                                          (NAME, "3"): _counts(10, 10)})):
                await nc.publish(stats_subject("gw-t"), stats.to_wire())
            await nc.flush()
        finally:
            await nc.close()

    async def hold(kv: Any) -> None:  # a live CI promote that holds the name for a moment
        now = time.time()
        await kv.create(lock_key(NAME), LockRecord("ci", "promote", "ci-host", 1, now, now + 600).to_bytes())

    async def release(kv: Any) -> None:
        await kv.delete(lock_key(NAME))

    def say(line: str) -> None:
        steps.append(line)
        if "watching canary v3" in line:
            kv_do(fleet.url, hold)
            off_loop(publish())
        elif "waiting for its release" in line and not any("released" in s for s in steps):
            steps.append("released")
            kv_do(fleet.url, release)

    out = watch.watch(NAME, WAIT_S, watch.Margins(min_requests=5), **fleet.kw, every_s=0.05, say=say)
    assert out.result == "aborted", (out, steps)
    assert any("waiting for its release" in s for s in steps), steps
    now = fleet.read(NAME)
    assert now.summary() == ("2", "2", None, None) and "3" in now.entry.retired, now  # type: ignore[union-attr]


def test_the_watch_says_so_when_the_lock_stays_held(fleet: Cluster) -> None:
    """Bounded: a holder that never lets go makes the abort fail loudly after `abort_within_s`, not hang."""
    fleet.start(NAME, "split")

    async def hold(kv: Any) -> None:
        now = time.time()
        await kv.create(lock_key(NAME), LockRecord("ci", "promote", "ci-host", 1, now, now + 600).to_bytes())

    async def wait_busy(kv: Any) -> None:
        with pytest.raises(can.CanaryError, match=r"another promote of legal is in progress.*waited 0\.3s"):
            await watch.while_busy(kv, NAME, lambda: can.abort_on(kv, NAME), 0.3)
        await kv.delete(lock_key(NAME))

    kv_do(fleet.url, hold)
    kv_do(fleet.url, wait_busy)
    assert fleet.read(NAME).summary() == ("2", "2", "3", None)  # nothing changed while it was refused


# -- item 9: the watch's connection ----------------------------------------------------------------------------------

def test_the_watch_connection_pings_and_reconnects_like_the_gateway(fleet: Cluster) -> None:
    from lorafleet.nats.client import MAX_OUTSTANDING_PINGS, PING_INTERVAL_S, RECONNECT_OPTIONS

    async def options(lasting: bool) -> dict[str, Any]:
        nc: Any = await prom._connect(fleet.url, lasting=lasting)
        try:
            return dict(nc.options)
        finally:
            await nc.close()

    lasting = asyncio.run(options(True))
    assert lasting["ping_interval"] == PING_INTERVAL_S and lasting["max_outstanding_pings"] == MAX_OUTSTANDING_PINGS
    assert lasting["allow_reconnect"] is True
    assert lasting["max_reconnect_attempts"] == RECONNECT_OPTIONS["max_reconnect_attempts"] == -1
    short = asyncio.run(options(False))  # a promote: fail fast, no reconnect
    assert short["allow_reconnect"] is False
