"""Promotions that overlap, and a promotion that dies half-way (issue 23): a real nats-server and a real MLflow store.

Two promotes of one name at once: one holds the name's lock in NATS KV from before it reads the champion until
after it wrote the fleet state, the other is refused at once; the alias, the fleet state and the champion history
agree afterwards. A promote that dies between moving the alias and writing the fleet state leaves them
disagreeing: the next `check`/promote sees it and repairs it.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from registry_kit import entries, register, write_fleet_file
from typer.testing import CliRunner

from lorafleet.cli import app
from lorafleet.core.fleet_state import FleetEntry, ensure_fleet_bucket, read_entries
from lorafleet.registry import promote as prom
from lorafleet.registry import store
from lorafleet.registry.writes import Killed, interrupted_after

pytestmark = pytest.mark.integration

WAIT_S = 20.0  # upper bound on any awaited event


@pytest.fixture
def fleet_file(tmp_path: Path) -> Path:
    return write_fleet_file(tmp_path / "fleet.yaml")


def test_two_promotes_of_one_name_at_once_one_wins(nats_server, fleet_file: Path, tiny_adapter: Path,
                                                   tiny_model_dir: Path) -> None:
    url = nats_server.url
    asyncio.run(entries(url, create=True))
    for score in (0.40, 0.45, 0.46):
        register(tiny_adapter, tiny_model_dir, score)
    prom.promote("legal", "1", nats_url=url, fleet_file=fleet_file)

    # Each promote, once past its preload, waits (in its own thread) until the other has finished: if both get
    # that far, the lock did not exclude them and both wait out WAIT_S. With the lock the loser is refused
    # before its preload and the winner goes on at once.
    finished = [threading.Event(), threading.Event()]

    def hold(me: int) -> prom.Preload:
        def progress(line: str) -> None:
            if "nothing to preload" in line:
                finished[1 - me].wait(WAIT_S)
        return prom.Preload(timeout_s=5.0, progress=progress)

    def run(me: int, version: str) -> prom.Outcome:
        try:
            return prom.promote("legal", version, nats_url=url, fleet_file=fleet_file, preload=hold(me))
        finally:
            finished[me].set()

    async def both() -> list[prom.Outcome | BaseException]:
        return await asyncio.gather(asyncio.to_thread(run, 0, "2"), asyncio.to_thread(run, 1, "3"),
                                    return_exceptions=True)

    results = asyncio.run(both())
    won = [r for r in results if isinstance(r, prom.Outcome)]
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(won) == 1 and len(lost) == 1, results
    assert isinstance(lost[0], prom.PromotionError), repr(lost[0])
    assert "another promote of legal is in progress" in str(lost[0])
    winner = won[0].version
    assert store.alias_version("legal", "champion") == winner
    assert asyncio.run(entries(url))["legal"].version == winner
    assert store.champion_history("legal") == ["1", winner]
    # The lock is gone: the loser's version can be promoted now (it passes the gate against either winner).
    if winner == "2":
        assert prom.promote("legal", "3", nats_url=url, fleet_file=fleet_file).previous == "2"
        assert store.champion_history("legal") == ["1", "2", "3"]


def test_a_crash_between_alias_and_fleet_state_is_repaired(nats_server, fleet_file: Path, tiny_adapter: Path,
                                                           tiny_model_dir: Path) -> None:
    url = nats_server.url
    asyncio.run(entries(url, create=True))
    for score in (0.40, 0.45, 0.46):
        register(tiny_adapter, tiny_model_dir, score)
    no_preload = prom.Preload(enabled=False)
    prom.promote("legal", "1", nats_url=url, fleet_file=fleet_file, preload=no_preload)

    # The process dies right after the alias moved: nothing it would still do (an undo) reaches any store.
    with interrupted_after("alias", kill=True), pytest.raises(Killed):
        prom.promote("legal", "2", nats_url=url, fleet_file=fleet_file, preload=no_preload)
    assert store.alias_version("legal", "champion") == "2"
    assert asyncio.run(entries(url))["legal"].version == "1"  # the disagreement the crash left

    found = prom.check("legal", nats_url=url, fleet_file=fleet_file)
    assert not found.agrees and (found.champion, found.served) == ("2", "1"), found
    assert asyncio.run(entries(url))["legal"].version == "1", "check alone changes nothing"
    cli = ["registry", "check", "legal", "--nats-url", url, "--fleet", str(fleet_file)]
    said = CliRunner().invoke(app, cli)
    assert said.exit_code == 1 and "disagree (champion v2, fleet serves v1" in said.output, said.output
    said = CliRunner().invoke(app, [*cli, "--repair"])
    assert said.exit_code == 0 and "legal: repaired; now champion v2, fleet serves v2" in said.output, said.output
    repaired = prom.check("legal", nats_url=url, fleet_file=fleet_file)
    assert repaired.agrees and not repaired.repaired, repaired
    assert asyncio.run(entries(url))["legal"].version == "2"
    assert store.champion_history("legal") == ["1", "2"]

    # The same crash again; this time the next promote repairs it on its own before it goes on.
    with interrupted_after("alias", kill=True), pytest.raises(Killed):
        prom.promote("legal", "3", nats_url=url, fleet_file=fleet_file, preload=no_preload)
    out = prom.rollback("legal", nats_url=url, fleet_file=fleet_file, preload=no_preload)
    assert out.repaired, "the rollback says it repaired the fleet state first"
    assert (out.previous, out.version) == ("3", "2")
    assert store.alias_version("legal", "champion") == "2"
    assert asyncio.run(entries(url))["legal"].version == "2"
    assert store.champion_history("legal") == ["1", "2"]


def test_a_change_during_the_preload_stops_the_promote(nats_server, fleet_file: Path, tiny_adapter: Path,
                                                       tiny_model_dir: Path) -> None:
    """The state is read again after the preload: an entry written meanwhile (by hand, say) is not overwritten."""
    url = nats_server.url
    asyncio.run(entries(url, create=True))
    for score in (0.40, 0.45):
        register(tiny_adapter, tiny_model_dir, score)
    prom.promote("legal", "1", nats_url=url, fleet_file=fleet_file, preload=prom.Preload(enabled=False))

    async def write_by_hand() -> None:
        import nats

        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().key_value("lorafleet_fleet")
            entry = FleetEntry.from_bytes((await kv.get("legal")).value)
            await kv.put("legal", entry.model_copy(update={"action": "set"}).to_bytes())
        finally:
            await nc.close()

    def progress(line: str) -> None:  # runs on the promote's own loop: write from another thread, wait for it
        if "nothing to preload" in line:
            writer = threading.Thread(target=asyncio.run, args=(write_by_hand(),))
            writer.start()
            writer.join(WAIT_S)

    with pytest.raises(prom.PromotionError, match=r"legal changed while the preload ran .*nothing changed"):
        prom.promote("legal", "2", nats_url=url, fleet_file=fleet_file, preload=prom.Preload(progress=progress))
    assert store.alias_version("legal", "champion") == "1"
    assert store.champion_history("legal") == ["1"]
    entry = asyncio.run(entries(url))["legal"]
    assert (entry.version, entry.action) == ("1", "set")


async def test_the_lock_excludes_is_released_and_expires(nats_server) -> None:
    import time

    import nats

    from lorafleet.registry.lock import LockBusy, LockRecord, lock_key, promote_lock

    nc = await nats.connect(nats_server.url)
    try:
        kv = await ensure_fleet_bucket(nc.jetstream())
        async with promote_lock(kv, "legal", "promote"):
            with pytest.raises(LockBusy, match=r"another promote of legal is in progress \(a promote by pid"):
                async with promote_lock(kv, "legal", "rollback"):
                    pass
        async with promote_lock(kv, "legal", "rollback") as held:  # released: taken at once
            assert held.record.action == "rollback"
        # A holder that was killed: no release, no renewal. Once its time is up the next one takes over.
        dead = LockRecord(owner="x", action="promote", host="elsewhere", pid=1, since=time.time() - 60,
                          expires=time.time() - 1)
        await kv.create(lock_key("legal"), dead.to_bytes())
        async with promote_lock(kv, "legal", "promote") as held:
            assert held.record.owner != "x"
        assert await read_entries(kv) == {}  # lock keys are never served names
    finally:
        await nc.close()
