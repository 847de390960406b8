"""The transitions canary.py and shadow.py share (issue 38): one path, so each property is tested once.

- `start_split`: a canary or a shadow starts the same way: connect, take the name's lock, read alias, history and
  live entry together (`Agreement`), refuse when they disagree, ask the kind of split whether it may start, gate,
  check the base, preload, check the lock, read again (anything changed: nothing changes), then one
  compare-and-set of the live entry with the split in it. The registry is not touched.
- `rewrite`: a change of the live entry alone (abort, the watch's mark, dropping a stale split) reads the entry
  under the lock, lets a function decide the new one, and writes it by compare-and-set. A change that ends a
  split (`Change.ends`) first moves the champion alias back to what the fleet serves when it names the ended
  version (a `--finish` that died after moving the alias): so no later repair, which follows the alias, can make
  an aborted version champion.

- `finish_split`: `--finish` of either goes through promote's switch (registry/promote.py): the split's version
  gated against the champion as it is then, preloaded, made champion; "done" as it stands when the repair at the
  switch's start already completed a finish that had died half-way (`finished_by_repair`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lorafleet.core.fleet_state import FleetEntry, read_entry
from lorafleet.core.tasks import GateResult
from lorafleet.registry import store
from lorafleet.registry.consistency import Agreement, history_with, repaired_history, snapshot
from lorafleet.registry.fleet_target import FleetTarget, fleet_bases, open_fleet
from lorafleet.registry.gate import PromotionError, default_margin, gate_or_refuse
from lorafleet.registry.lock import HeldLock, locked
from lorafleet.registry.promote import Outcome, switch
from lorafleet.registry.staging import Preload, served_entry, staged
from lorafleet.registry.store import CHAMPION, VersionInfo
from lorafleet.registry.writes import in_thread, reached, run_transition, write_alias, write_fleet, write_history


def check_share(percent: float, flag: str, what: str, error: type[Exception], hint: str = "") -> float:
    """A split's share (`--canary P`, `--shadow P`), strictly between 0 and 100, else `error` naming the flag."""
    if not isinstance(percent, int | float) or math.isnan(percent) or not 0 < percent < 100:
        raise error(f"{flag} {percent}: the share must be more than 0 and less than 100 (percent of the name's "
                    f"{what}){hint}")
    return float(percent)


@dataclass(frozen=True)
class Split:
    """What differs between starting a canary and a shadow."""

    action: str  # the lock's action: "canary", "shadow"
    error: type[PromotionError]  # what a refusal raises
    allowed: Callable[[Agreement], None]  # raises `error` when the name's state refuses this split
    place: Callable[[FleetEntry, FleetEntry], FleetEntry]  # (live entry, candidate's entry) -> the entry to write


async def _start(target: FleetTarget, name: str, info: VersionInfo, split: Split,
                 gate: Callable[[str | None], GateResult], preload: Preload) -> tuple[FleetEntry, GateResult]:
    async with open_fleet(target.nats_url, target.client) as (nc, kv):
        bases = await fleet_bases(nc, target)
        async with locked(kv, name, split.action, split.error) as lock:
            state = await snapshot(kv, name)
            if not state.agrees:
                raise split.error(f"{name}: the registry and the fleet disagree ({state.describe()}); run "
                                  f"`lorafleet registry check {name} --repair` first")
            split.allowed(state)
            verdict = await in_thread(gate, state.champion)
            candidate = await served_entry(info, bases, "promote", split.error)
            async with staged(nc, kv, candidate, target, preload):
                await lock.verify()
                fresh = await snapshot(kv, name)
                reached("read")
                if fresh.key() != state.key() or fresh.entry is None:
                    raise split.error(f"{name} changed while the preload ran (was: {state.describe()}; now: "
                                      f"{fresh.describe()}); nothing changed. Run it again")
                entry = split.place(fresh.entry, candidate)
                await write_fleet(lock, kv, entry, fresh.revision)
    return entry, verdict


def start_split(target: FleetTarget, name: str, info: VersionInfo, split: Split, *, margin: float | None,
                force: bool, preload: Preload | None) -> tuple[FleetEntry, GateResult]:
    """Start `split` of `info` (see the module docstring), gated against the champion read under the lock; the live
    entry written and the gate's verdict."""
    return run_transition(_start(target, name, info, split, lambda champion: gate_or_refuse(info, champion, margin,
                                                                                            force),
                                 preload or Preload()))


@dataclass(frozen=True)
class Change:
    """A new live entry decided under the lock; `ends`: the canary or shadow version it takes out."""

    entry: FleetEntry
    ends: str | None = None
    why: str | None = None


async def _alias_off(lock: HeldLock, entry: FleetEntry, gone: str) -> None:
    """When the alias names `gone` (a finish of it died after moving the alias), put alias and history back on
    the version the fleet serves, before the split ends."""
    if entry.version == gone or await in_thread(store.alias_version, entry.name, CHAMPION) != gone:
        return
    history = tuple(await in_thread(store.champion_history, entry.name))
    await write_alias(lock, entry.name, entry.version)
    trimmed = repaired_history(history, entry.version)
    if trimmed != history:
        await write_history(lock, entry.name, trimmed)


async def rewrite(kv: Any, lock: HeldLock, name: str, change: Callable[[FleetEntry | None], Change | None]
                  ) -> Change | None:
    """Read the live entry, let `change` (run in a thread: it may ask the registry; it raises to refuse) decide,
    write its entry by compare-and-set; None when it decided there is nothing to do."""
    entry, revision = await read_entry(kv, name)
    reached("read")
    decided = await in_thread(change, entry)
    if decided is None:
        return None
    if decided.ends is not None and entry is not None:
        await _alias_off(lock, entry, decided.ends)
    await write_fleet(lock, kv, decided.entry, revision)
    return decided


def finished_by_repair(state: Agreement, version: str) -> bool:
    """Whether the repair at the start of a `--finish` of `version` already made it champion (a finish of it had
    died after moving the alias): the finish is then done."""
    before = state.before.entry if state.before is not None else None
    if not state.repaired or before is None or state.champion != version or state.served != version:
        return False
    return any(s is not None and s.version == version for s in (before.canary, before.shadow))


def finish_split(target: FleetTarget, name: str, pick: Callable[[Agreement], str],
                 repaired: Callable[[Agreement], str | None], *, margin: float | None, force: bool,
                 preload: Preload | None) -> Outcome:
    """`--finish`: the version `pick` names (it raises to refuse) becomes champion through promote's switch, gated
    against the champion as it is then; when the repair at the switch's start already made the version `repaired`
    names champion (`finished_by_repair`), the finish is done as it stands."""
    margin = default_margin() if margin is None else margin

    def decide(state: Agreement) -> tuple[VersionInfo, tuple[str, ...], GateResult | None]:
        done = repaired(state)
        if done is not None and finished_by_repair(state, done):
            return store.get_version(name, done), history_with(state.history, done), None
        info = store.get_version(name, pick(state))
        return info, history_with(state.history, info.version), gate_or_refuse(info, state.champion, margin, force)

    return switch(target, name, "promote", decide, preload)


__all__ = ["Change", "Split", "check_share", "finish_split", "finished_by_repair", "rewrite", "start_split"]
