"""The retention decision of a promote (issue 25), pure: which former champions stay served as NAME@N."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lorafleet.core.fleet_state import FleetEntry, Retention, by_adapter_id, retained_live, with_retention

DAY = 86400.0


def _entry(version: str) -> FleetEntry:
    return FleetEntry(name="legal", base="tiny", adapter_id=f"legal@v{version}", adapter_uri=f"models:/legal/{version}",
                      version=version, registered_model="legal", action="promote")


def _chain(versions: list[str], retention: Retention, times: list[float]) -> FleetEntry:
    """Promote each version in turn at the given times, as promote does: the new entry from the live one."""
    live: FleetEntry | None = None
    for v, t in zip(versions, times, strict=True):
        live = with_retention(live, _entry(v), retention, t)
    assert live is not None
    return live


def test_first_promote_retains_nothing() -> None:
    e = with_retention(None, _entry("1"), Retention(), 0.0)
    assert (e.retained, e.retired) == ([], [])


def test_previous_champion_is_retained_for_the_window() -> None:
    e = _chain(["1", "2"], Retention(7 * DAY, 2), [0.0, 100.0])
    assert [r.version for r in e.retained] == ["1"]
    kept = e.retained[0]
    assert (kept.adapter_id, kept.adapter_uri, kept.superseded, kept.until) == \
        ("legal@v1", "models:/legal/1", 100.0, 100.0 + 7 * DAY)
    assert [r.version for r in retained_live(e, 100.0 + 7 * DAY - 1)] == ["1"]
    assert retained_live(e, 100.0 + 7 * DAY) == []  # the window is over: the gateway answers 410


def test_count_limit_retires_the_oldest() -> None:
    e = _chain(["1", "2", "3", "4"], Retention(None, 2), [0.0, 1.0, 2.0, 3.0])
    assert [r.version for r in e.retained] == ["3", "2"]
    assert e.retired == ["1"]
    assert all(r.until is None for r in e.retained)


def test_time_limit_retires_at_the_next_write() -> None:
    e = _chain(["1", "2", "3"], Retention(10.0, None), [0.0, 1.0, 50.0])
    assert [r.version for r in e.retained] == ["2"]  # v1's window ended at 11
    assert e.retired == ["1"]


def test_zero_retains_nothing_and_remembers_the_old_version() -> None:
    e = _chain(["1", "2"], Retention(7 * DAY, 0), [0.0, 1.0])
    assert (e.retained, e.retired) == ([], ["1"])
    e = _chain(["1", "2"], Retention(0.0, 2), [0.0, 1.0])
    assert (e.retained, e.retired) == ([], ["1"])


def test_rollback_makes_the_retained_version_live_and_retains_the_bad_one() -> None:
    e = _chain(["1", "2", "1"], Retention(7 * DAY, 2), [0.0, 1.0, 2.0])
    assert e.version == "1"
    assert [r.version for r in e.retained] == ["2"]  # its clients' indexes keep working too
    assert e.retired == []
    # Promoting a retired version again takes it off the retired list.
    e = _chain(["1", "2", "3", "1"], Retention(7 * DAY, 1), [0.0, 1.0, 2.0, 3.0])
    assert [r.version for r in e.retained] == ["3"] and "1" not in e.retired and e.retired == ["2"]


def test_republishing_the_same_version_changes_nothing() -> None:
    first = _chain(["1", "2"], Retention(7 * DAY, 2), [0.0, 1.0])
    again = with_retention(first, _entry("2"), Retention(7 * DAY, 2), 5.0)
    assert again.retained == first.retained and again.retired == first.retired


def test_entry_round_trips_and_workers_know_retained_adapters() -> None:
    e = _chain(["1", "2"], Retention(), [0.0, 1.0])
    assert FleetEntry.from_bytes(e.to_bytes()) == e
    # An entry written before issue 25 (no retained/retired keys) still reads.
    old = _entry("1").model_dump(exclude={"retained", "retired"})
    assert FleetEntry.model_validate(old).retained == []
    # One that retains nothing is written without the new keys: older gateways and workers still read it.
    assert b"retained" not in _entry("1").to_bytes() and b"retained" in e.to_bytes()
    served = by_adapter_id([e])
    assert served["legal@v1"].adapter == "models:/legal/1" and served["legal@v2"].adapter == "models:/legal/2"


@pytest.mark.parametrize("retention, text", [(Retention(), "7 days, 2 former version(s)"),
                                             (Retention(None, None), "no time limit, any number of former version(s)")])
def test_describe(retention: Retention, text: str) -> None:
    assert retention.describe() == text


@pytest.mark.parametrize("text, seconds", [("7d", 7 * DAY), ("12h", 43200.0), ("30m", 1800.0), ("90s", 90.0),
                                           ("45", 45.0), ("0", 0.0), ("forever", None), ("1w", 7 * DAY)])
def test_parse_duration(text: str, seconds: float | None) -> None:
    from lorafleet.cli.registry import parse_duration

    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "d", "-1d", "7x"])
def test_parse_duration_refuses(text: str) -> None:
    from lorafleet.cli.registry import parse_duration

    with pytest.raises(ValueError):
        parse_duration(text)


def test_client_notes_say_what_changed() -> None:
    from lorafleet.cli.registry import client_notes

    e = _chain(["1", "2"], Retention(DAY, 2), [0.0, 0.0])
    notes = "\n".join(client_notes(e, "1"))
    assert "legal now answers with v2 (responses name legal@2)" in notes
    assert "legal@1 is still served until 1970-01-02 00:00 UTC" in notes
    assert "embed your corpus with model legal@2" in notes and "stop using legal@1" in notes
    e = _chain(["1", "2"], Retention(DAY, 0), [0.0, 0.0])
    assert "legal@1 is retired now" in "\n".join(client_notes(e, "1"))
    assert len(client_notes(_chain(["1"], Retention(), [0.0]), None)) == 1  # a first promote: nothing to re-index


@pytest.mark.integration
def test_promote_cli_retains_and_prints(nats_server: Any, tmp_path: Path, tiny_adapter: Path, tiny_model_dir: Path
                                        ) -> None:
    """`lorafleet promote --retain`: the retained version is in the fleet state (under the name's key, written by the
    promotion's compare-and-set) and the output tells clients what changed."""
    import asyncio

    import nats
    from typer.testing import CliRunner

    from lorafleet.cli import app
    from lorafleet.core.config import BaseModelSpec, FleetConfig
    from lorafleet.core.fleet_state import ensure_fleet_bucket, read_entries
    from lorafleet.registry import store

    for score in (0.40, 0.45):
        store.register_bundle("legal", tiny_adapter, base_source=str(tiny_model_dir), base_name="tiny",
                              metrics={"test_ndcg@10": score, "base_test_ndcg@10": 0.30})
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(FleetConfig(bases=[BaseModelSpec(name="tiny", source="x")]).model_dump_json())

    async def entries(create: bool) -> dict[str, FleetEntry]:
        nc = await nats.connect(nats_server.url)
        try:
            kv = await ensure_fleet_bucket(nc.jetstream())
            return {} if create else await read_entries(kv)
        finally:
            await nc.close()

    asyncio.run(entries(True))
    common = ["--nats-url", nats_server.url, "--fleet", str(fleet_file), "--no-preload"]
    res = CliRunner().invoke(app, ["promote", "legal", "-v", "1", *common])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["promote", "legal", "-v", "2", "--retain", "1h", "--retain-versions", "1", *common])
    assert res.exit_code == 0, res.output
    assert "legal@1 is still served until" in res.output and "embed your corpus with model legal@2" in res.output
    entry = asyncio.run(entries(False))["legal"]
    assert entry.version == "2" and [r.version for r in entry.retained] == ["1"]
    kept = entry.retained[0]
    assert kept.until is not None and abs(kept.until - kept.superseded - 3600.0) < 1e-6
    res = CliRunner().invoke(app, ["promote", "legal", "-v", "2", "--retain", "soon", *common])
    assert res.exit_code != 0 and "not a duration" in res.output


@pytest.mark.integration
def test_concurrent_promotes_never_lose_a_retained_version(nats_server: Any, tmp_path: Path, tiny_adapter: Path,
                                                          tiny_model_dir: Path) -> None:
    """Two promotes of one name at once (v2, v3 on top of v1): whichever wins (or both, one after the other), the
    entry retains exactly the former champions of the champion history, newest first: the retained list is
    written by the same locked compare-and-set as the live version, so neither write drops the other's."""
    import asyncio

    import nats

    from lorafleet.core.config import BaseModelSpec, FleetConfig
    from lorafleet.core.fleet_state import ensure_fleet_bucket, read_entries
    from lorafleet.registry import promote as prom
    from lorafleet.registry import store

    for score in (0.40, 0.45, 0.46):
        store.register_bundle("legal", tiny_adapter, base_source=str(tiny_model_dir), base_name="tiny",
                              metrics={"test_ndcg@10": score, "base_test_ndcg@10": 0.30})
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(FleetConfig(bases=[BaseModelSpec(name="tiny", source="x")]).model_dump_json())

    async def entries() -> dict[str, FleetEntry]:
        nc = await nats.connect(nats_server.url)
        try:
            return await read_entries(await ensure_fleet_bucket(nc.jetstream()))
        finally:
            await nc.close()

    asyncio.run(entries())
    keep = Retention(None, 5)
    prom.promote("legal", "1", nats_url=nats_server.url, fleet_file=fleet_file, retention=keep)

    async def both() -> list[Any]:
        run = [asyncio.to_thread(prom.promote, "legal", v, nats_url=nats_server.url, fleet_file=fleet_file,
                                 retention=keep) for v in ("2", "3")]
        return await asyncio.gather(*run, return_exceptions=True)

    results = asyncio.run(both())
    assert any(isinstance(r, prom.Outcome) for r in results), results
    for r in results:
        # The loser: refused by the lock, or (when v3 finished first) by the gate against the new champion v3.
        assert isinstance(r, prom.Outcome) or any(why in str(r) for why in (
            "another promote of legal is in progress", "fails the quality gate")), repr(r)
    history = store.champion_history("legal")
    entry = asyncio.run(entries())["legal"]
    assert entry.version == history[-1]
    assert [r.version for r in entry.retained] == history[-2::-1], (history, entry.retained)
