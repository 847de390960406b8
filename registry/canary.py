"""Canary promotion (issue 25): part of a name's traffic on a candidate version before it becomes champion.

`lorafleet promote NAME --canary P` passes the same gate and preload as a promote, then writes a canary spec into
the name's live fleet entry (under the promote lock, by compare-and-set): every gateway sends the plain name's
requests whose route key falls below P % (lorafleet.core.fleet_state.route_bucket: sticky per client, the same on
every gateway and after a restart) to the candidate, the rest to the champion; both stay served as NAME@N.
`--finish` makes the candidate champion through promote's own path (gate, preload, retention of the old champion:
the canary goes with the entry it rewrites); `--abort` removes the canary, the champion unchanged. While a canary
runs, a plain promote or rollback of the name is refused (fleet_state.refuse_during_canary).

Start and abort share their path with shadow.py (registry/transition.py). `--abort` after a `--finish` that
died half-way (the alias already names the canary) puts the alias back on the champion before it ends the canary:
the aborted version never becomes champion by a later repair (issue 38).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.core.fleet_state import FleetEntry, Retention, canary_in_progress, canary_spec, read_entries
from lorafleet.core.tasks import GateResult
from lorafleet.nats.client import ClientSettings
from lorafleet.registry.consistency import Agreement
from lorafleet.registry.fleet_target import find_fleet, open_fleet, target_retention
from lorafleet.registry.gate import PromotionError, gated_candidate
from lorafleet.registry.lock import LockBusy, locked
from lorafleet.registry.promote import Outcome
from lorafleet.registry.staging import Preload
from lorafleet.registry.transition import Change, Split, check_share, finish_split, rewrite, start_split
from lorafleet.registry.writes import run_transition


class CanaryError(PromotionError):
    """A canary command that does not fit the name's state; nothing changed."""


def check_percent(percent: float) -> float:
    """The canary's share, strictly between 0 and 100 (0 is no canary, 100 is a promote)."""
    return check_share(percent, "--canary", "traffic", CanaryError, "; for all of it, promote without --canary")


@dataclass(frozen=True)
class CanaryState:
    """One name's champion and canary, and the transitions between them; each refused transition raises
    CanaryError (read under the name's promote lock, so the answer holds until the write)."""

    name: str
    champion: str | None
    canary: str | None = None
    percent: float = 0.0

    @classmethod
    def of(cls, name: str, entry: FleetEntry | None) -> CanaryState:
        if entry is None:
            return cls(name, None)
        c = entry.canary
        return cls(name, entry.version, c.version if c else None, c.percent if c else 0.0)

    def start(self, version: str, percent: float) -> CanaryState:
        percent = check_percent(percent)
        if self.canary is not None:
            raise CanaryError(f"a canary of {self.name} is already in progress (v{self.canary} at {self.percent:g} "
                              f"%); nothing changed. End it first: `lorafleet promote {self.name} --finish` or "
                              "`--abort`")
        if self.champion is None:
            raise CanaryError(f"{self.name} is not served yet: a canary splits a served name's traffic between its "
                              f"champion and a candidate; promote a first version without --canary")
        if version == self.champion:
            raise CanaryError(f"v{version} is already the champion of {self.name}; nothing to canary")
        return dataclasses.replace(self, canary=version, percent=percent)

    def finish(self) -> CanaryState:
        if self.canary is None:
            raise CanaryError(f"{self.name} has no canary in progress to finish (start one with "
                              f"`lorafleet promote {self.name} --canary P`); nothing changed")
        return CanaryState(self.name, self.canary)

    def abort(self) -> CanaryState:
        if self.canary is None:
            raise CanaryError(f"{self.name} has no canary in progress to abort; nothing changed")
        return CanaryState(self.name, self.champion)


@dataclass(frozen=True)
class CanaryOutcome:
    name: str
    champion: str
    canary: str | None  # None after --abort
    percent: float
    entry: FleetEntry
    gate: GateResult | None
    nats_url: str
    aborted: str | None = None  # the version --abort took out


def start(name: str, version: str | int | None, percent: float, *, force: bool = False, margin: float | None = None,
          nats_url: str | None = None, fleet_file: Path | None = None, creds: Path | None = None,
          preload: Preload | None = None) -> CanaryOutcome:
    """Gate and preload `version` (default: the `candidate` alias, else the newest) like a promote, then send
    `percent` % of the name's route keys to it. Refused, changing nothing, for a bad share, a name not served, a
    canary already running or another promote holding the name."""
    check_percent(percent)  # before anything: a bad flag needs neither the registry nor the cluster
    info, margin = gated_candidate(name, version, margin, force)
    target = find_fleet(nats_url, fleet_file, creds)

    def allowed(state: Agreement) -> None:
        CanaryState.of(name, state.entry).start(info.version, percent)
        if state.entry is not None and state.entry.shadow is not None:  # one experiment at a time
            raise CanaryError(str(canary_in_progress(state.entry)))

    def place(live: FleetEntry, candidate: FleetEntry) -> FleetEntry:
        return live.model_copy(update={"canary": canary_spec(candidate, percent)})

    entry, gate = start_split(target, name, info, Split("canary", CanaryError, allowed, place), margin=margin,
                              force=force, preload=preload)
    return CanaryOutcome(name, entry.version, info.version, percent, entry, gate, target.nats_url)


def finish(name: str, *, force: bool = False, margin: float | None = None, nats_url: str | None = None,
           fleet_file: Path | None = None, creds: Path | None = None, preload: Preload | None = None,
           retention: Retention | None = None, retention_changes: dict[str, float | int | None] | None = None,
           expect: str | None = None) -> Outcome:
    """The canary becomes champion through promote's path (gate against the champion as it is then, preload,
    compare-and-set, the old champion retained as NAME@N); the entry it writes has no canary. A finish that died
    after moving the alias is completed by the repair this one starts with: then it is done as it stands."""
    target = target_retention(find_fleet(nats_url, fleet_file, creds), retention, retention_changes)

    def pick(state: Agreement) -> str:
        before = CanaryState.of(name, state.entry)
        _expect(before, expect)
        after = before.finish()
        assert after.champion is not None
        return after.champion

    return finish_split(target, name, pick, lambda state: expect if expect is not None else state.champion,
                        margin=margin, force=force, preload=preload)


def _expect(state: CanaryState, version: str | None) -> None:
    """`--watch` ends the canary it watched, never one started after it ended."""
    if version is not None and state.canary is not None and state.canary != version:
        raise CanaryError(f"{state.name}: the canary in progress is v{state.canary}, not the watched v{version}; "
                          "nothing changed")


def _aborted(name: str, expect: str | None) -> Callable[[FleetEntry | None], Change]:
    """The entry without its canary, the canary's version retired (unless it is a retained former champion)."""
    def change(entry: FleetEntry | None) -> Change:
        _expect(CanaryState.of(name, entry), expect)
        CanaryState.of(name, entry).abort()
        assert entry is not None and entry.canary is not None
        gone = entry.canary.version
        kept = {r.version for r in entry.retained}
        retired = entry.retired if gone in kept else [gone, *(v for v in entry.retired if v != gone)]
        return Change(entry.model_copy(update={"canary": None, "retired": retired}), ends=gone)
    return change


async def abort_on(kv: Any, name: str, *, expect: str | None = None) -> tuple[FleetEntry, str]:
    """`abort` on an open bucket (the watch's own connection); LockBusy when another holds the name. The entry
    written and the version taken out. When the alias names the canary (a `--finish` that died after moving
    it), the alias and history go back to the champion first (transition.rewrite)."""
    async with locked(kv, name, "canary abort", None) as lock:
        done = await rewrite(kv, lock, name, _aborted(name, expect))
    assert done is not None and done.ends is not None
    return done.entry, done.ends


def abort(name: str, *, nats_url: str | None = None, fleet_file: Path | None = None, creds: Path | None = None,
          expect: str | None = None) -> CanaryOutcome:
    """Remove the canary: every request of the plain name goes to the champion again; the canary's version is no
    longer served (NAME@N for it answers 410 unless it is a retained former champion), and never becomes
    champion by a later repair."""
    target = find_fleet(nats_url, fleet_file, creds)

    async def run() -> tuple[FleetEntry, str]:
        async with open_fleet(target.nats_url, target.client) as (_, kv):
            try:
                return await abort_on(kv, name, expect=expect)
            except LockBusy as exc:
                raise CanaryError(str(exc)) from exc

    new, gone = run_transition(run())
    return CanaryOutcome(name, new.version, None, 0.0, new, None, target.nats_url, aborted=gone)


def describe(entry: FleetEntry) -> dict[str, Any]:
    """A name's split as `lorafleet status` shows it."""
    c = entry.canary
    assert c is not None
    return {"name": entry.name, "champion": entry.version, "canary": c.version, "percent": c.percent,
            "champion_percent": 100.0 - c.percent, "started": c.started, "watcher": c.watcher,
            "watch_until": c.watch_until}


def watch_line(c: dict[str, Any], cluster: dict[str, dict[str, Any]], now: float | None = None) -> str:
    """How `lorafleet status` says who watches a canary (`describe`'s dict; `cluster`: presence keyed role/name):
    watched only while its window runs and the watcher named in the spec is heard (presence
    `control/watch-<name>` from that host/pid); else nobody, whatever the spec still says (a watcher that died)."""
    now = time.time() if now is None else now
    until, watcher = c.get("watch_until"), c.get("watcher")
    p = cluster.get(f"control/watch-{c['name']}")
    if watcher and until is not None and until > now and p is not None and f"{p['host']}/{p['pid']}" == watcher:
        return f"watched by {watcher} until {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(until))}"
    return "nobody watches (it stays at its percentage until --finish/--abort or --watch)"


async def read_canaries(nats_url: str, client: ClientSettings | None = None) -> list[dict[str, Any]]:
    """Every canary in the fleet state (for `lorafleet status`)."""
    async with open_fleet(nats_url, client) as (_, kv):
        return [describe(e) for _, e in sorted((await read_entries(kv)).items()) if e.canary is not None]


__all__ = ["CanaryError", "CanaryOutcome", "CanaryState", "abort", "abort_on", "canary_in_progress", "check_percent",
           "finish", "read_canaries", "start", "watch_line"]
