"""`promote --canary / --finish / --abort` (issue 25, part 3) against a real nats-server and a real MLflow store:
the canary's state transitions, the bad inputs that change nothing, the canary that holds a name against a plain
promote, and a canary and a promote that start together."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from registry_kit import entries, register, write_fleet_file
from typer.testing import CliRunner

from lorafleet.cli import app
from lorafleet.core.fleet_state import CanaryInProgress
from lorafleet.registry import canary as can
from lorafleet.registry import promote as prom
from lorafleet.registry import store

WAIT_S = 20.0


# -- pure: the transitions ------------------------------------------------------------------------

def test_canary_state_transitions() -> None:
    none = can.CanaryState("legal", None)
    with pytest.raises(can.CanaryError, match="not served yet"):
        none.start("1", 10)
    served = can.CanaryState("legal", "1")
    running = served.start("2", 10)
    assert running == can.CanaryState("legal", "1", "2", 10.0)
    with pytest.raises(dataclass_frozen_error()):
        running.canary = "3"  # type: ignore[misc]
    with pytest.raises(can.CanaryError, match="already in progress"):
        running.start("3", 5)
    with pytest.raises(can.CanaryError, match="already the champion"):
        served.start("1", 10)
    assert running.finish() == can.CanaryState("legal", "2")
    assert running.abort() == served
    for end in (served.finish, served.abort):
        with pytest.raises(can.CanaryError, match="no canary in progress"):
            end()


def dataclass_frozen_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("bad", [0, 0.0, 100, 150, -5, float("nan")])
def test_canary_share_outside_0_100_is_refused(bad: float) -> None:
    with pytest.raises(can.CanaryError, match="more than 0 and less than 100"):
        can.check_percent(bad)
    with pytest.raises(can.CanaryError, match="more than 0 and less than 100"):
        can.CanaryState("legal", "1").start("2", bad)


def test_cli_bad_flags_change_nothing() -> None:
    runner = CliRunner()
    for args, says in ((["--canary", "0"], "more than 0 and less than 100"),
                       (["--canary", "100"], "more than 0 and less than 100"),
                       (["--finish", "--abort"], "do not go together"),
                       (["--canary", "10", "--finish"], "do not go together"),
                       (["--finish", "--version", "2"], "leave out --version")):
        res = runner.invoke(app, ["promote", "legal", *args, "--nats-url", "nats://127.0.0.1:1"])
        assert res.exit_code == 1 and says in res.output, (args, res.output)


# -- a real nats-server and MLflow -------------------------------------------------------------------


@pytest.fixture
def fleet_file(tmp_path: Path) -> Path:
    return write_fleet_file(tmp_path / "fleet.yaml")


@pytest.mark.integration
def test_canary_start_abort_finish_and_what_it_refuses(nats_server, fleet_file: Path, tiny_adapter: Path,
                                                       tiny_model_dir: Path) -> None:
    url = nats_server.url
    asyncio.run(entries(url, create=True))
    for score in (0.40, 0.45, 0.46):
        register(tiny_adapter, tiny_model_dir, score)
    kw = {"nats_url": url, "fleet_file": fleet_file}
    with pytest.raises(can.CanaryError, match="not served yet"):
        can.start("legal", "2", 10, **kw)
    assert asyncio.run(entries(url)) == {}
    prom.promote("legal", "1", **kw)
    for end in (lambda: can.abort("legal", **kw), lambda: can.finish("legal", **kw)):
        with pytest.raises(can.CanaryError, match="no canary in progress"):
            end()
    before = asyncio.run(entries(url))["legal"]
    assert before.canary is None

    out = can.start("legal", "2", 10, **kw)
    entry = asyncio.run(entries(url))["legal"]
    assert (out.champion, out.canary, entry.version, entry.canary.version, entry.canary.percent) == \
        ("1", "2", "1", "2", 10.0)
    assert store.alias_version("legal", "champion") == "1"  # the champion has not moved
    # While it runs: a plain promote of another version, a rollback, a second canary are refused, nothing changed.
    with pytest.raises(CanaryInProgress, match="canary of legal is in progress"):
        prom.promote("legal", "3", **kw)
    with pytest.raises(can.CanaryError, match="already in progress"):
        can.start("legal", "3", 5, **kw)
    assert asyncio.run(entries(url))["legal"] == entry
    assert store.alias_version("legal", "champion") == "1"
    assert CliRunner().invoke(app, ["promote", "legal", "--version", "3", "--nats-url", url, "--fleet",
                                    str(fleet_file)]).exit_code == 1

    out = can.abort("legal", **kw)
    after = asyncio.run(entries(url))["legal"]
    assert out.aborted == "2" and after.canary is None and after.version == "1" and "2" in after.retired
    assert store.alias_version("legal", "champion") == "1"

    res = CliRunner().invoke(app, ["promote", "legal", "--version", "3", "--canary", "20", "--nats-url", url,
                                   "--fleet", str(fleet_file)])
    assert res.exit_code == 0 and "canary v3 takes 20 %" in res.output, res.output
    done = can.finish("legal", **kw)
    final = asyncio.run(entries(url))["legal"]
    assert (done.version, done.previous, final.version, final.canary) == ("3", "1", "3", None)
    assert [r.version for r in final.retained] == ["1"]  # the old champion retained, as a promote does
    assert store.alias_version("legal", "champion") == "3" and store.champion_history("legal") == ["1", "3"]


@pytest.mark.integration
def test_a_canary_and_a_promote_at_once_one_wins(nats_server, fleet_file: Path, tiny_adapter: Path,
                                                 tiny_model_dir: Path) -> None:
    url = nats_server.url
    asyncio.run(entries(url, create=True))
    for score in (0.40, 0.45, 0.46):
        register(tiny_adapter, tiny_model_dir, score)
    prom.promote("legal", "1", nats_url=url, fleet_file=fleet_file)
    finished = [threading.Event(), threading.Event()]

    def hold(me: int) -> prom.Preload:  # past its preload, each waits for the other: only the lock prevents both
        def progress(line: str) -> None:
            if "nothing to preload" in line:
                finished[1 - me].wait(WAIT_S)
        return prom.Preload(timeout_s=5.0, progress=progress)

    def run(me: int) -> object:
        try:
            if me == 0:
                return can.start("legal", "2", 30, nats_url=url, fleet_file=fleet_file, preload=hold(0))
            return prom.promote("legal", "3", nats_url=url, fleet_file=fleet_file, preload=hold(1))
        finally:
            finished[me].set()

    async def both() -> list[object]:
        return await asyncio.gather(asyncio.to_thread(run, 0), asyncio.to_thread(run, 1), return_exceptions=True)

    results = asyncio.run(both())
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(lost) == 1 and "another promote of legal is in progress" in str(lost[0]), results
    entry = asyncio.run(entries(url))["legal"]
    if isinstance(results[0], can.CanaryOutcome):
        assert entry.version == "1" and entry.canary is not None and entry.canary.version == "2"
        assert store.alias_version("legal", "champion") == "1"
    else:
        assert entry.version == "3" and entry.canary is None
        assert store.alias_version("legal", "champion") == "3"
