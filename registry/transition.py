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

`--finish` of either goes through promote's switch (registry/promote.py); `finished_by_repair` lets it answer
"done" when the repair at its start already completed a finish that had died half-way.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from lorafleet.core.fleet_state import FleetEntry, delete_staged, open_fleet_bucket, read_entry
from lorafleet.core.tasks import GateResult
from lorafleet.registry import store
from lorafleet.registry.lock import HeldLock, LockBusy, LockLost, promote_lock
from lorafleet.registry.promote import (
    Agreement,
    FleetTarget,
    Preload,
    PromotionError,
    _bases,
    _connect,
    _entry,
    _gate_or_refuse,
    _preload,
    _snapshot,
    default_margin,
    repaired_history,
)
from lorafleet.registry.store import CANDIDATE, CHAMPION, VersionInfo
from lorafleet.registry.writes import in_thread, reached, write_alias, write_fleet, write_history


@contextlib.asynccontextmanager
async def connected(target: FleetTarget, *, lasting: bool = False) -> AsyncIterator[tuple[Any, Any]]:
    """(connection, fleet bucket) for the block; `lasting`: pings and reconnects (promote's `_connect`)."""
    nc: Any = await _connect(target.nats_url, target.client, lasting=lasting)
    try:
        yield nc, await open_fleet_bucket(nc.jetstream())
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


@contextlib.asynccontextmanager
async def locked(kv: Any, name: str, action: str, error: type[Exception] | None) -> AsyncIterator[HeldLock]:
    """The name's promote lock for the block; LockBusy (and LockLost) become `error` (None: raised as they are, for
    a caller that waits and tries again)."""
    try:
        async with promote_lock(kv, name, action) as lock:
            yield lock
    except (LockBusy, LockLost) as exc:
        if error is None:
            raise
        raise error(str(exc)) from exc


def check_share(percent: float, flag: str, what: str, error: type[Exception], hint: str = "") -> float:
    """A split's share (`--canary P`, `--shadow P`), strictly between 0 and 100, else `error` naming the flag."""
    if not isinstance(percent, int | float) or math.isnan(percent) or not 0 < percent < 100:
        raise error(f"{flag} {percent}: the share must be more than 0 and less than 100 (percent of the name's "
                    f"{what}){hint}")
    return float(percent)


def gated_candidate(name: str, version: str | int | None, margin: float | None, force: bool
                    ) -> tuple[VersionInfo, float]:
    """The version a split starts on (default: the `candidate` alias, else the newest) once it passed promote's
    gate against today's champion, and the margin that gate used (the one research recorded, by default)."""
    margin = default_margin() if margin is None else margin
    if version is None:
        version = store.alias_version(name, CANDIDATE)
    info = store.get_version(name, version)
    _gate_or_refuse(info, store.alias_version(name, CHAMPION), margin, force)
    return info, margin


@dataclass(frozen=True)
class Split:
    """What differs between starting a canary and a shadow."""

    action: str  # the lock's action: "canary", "shadow"
    error: type[PromotionError]  # what a refusal raises
    allowed: Callable[[Agreement], None]  # raises `error` when the name's state refuses this split
    place: Callable[[FleetEntry, FleetEntry], FleetEntry]  # (live entry, candidate's entry) -> the entry to write


async def start_split(target: FleetTarget, name: str, info: VersionInfo, split: Split,
                      gate: Callable[[str | None], GateResult], preload: Preload) -> tuple[FleetEntry, GateResult]:
    """Start `split` of `info` (see the module docstring); the live entry written and the gate's verdict."""
    async with connected(target) as (nc, kv):
        bases = await _bases(nc, target)
        async with locked(kv, name, split.action, split.error) as lock:
            state = await _snapshot(kv, name)
            if not state.agrees:
                raise split.error(f"{name}: the registry and the fleet disagree ({state.describe()}); run "
                                  f"`lorafleet registry check {name} --repair` first")
            split.allowed(state)
            verdict = await in_thread(gate, state.champion)
            _, spec = await in_thread(store.bundle_spec, info.name, info.version)
            if spec.base.name not in bases:
                raise split.error(f"{name} v{info.version} runs on base {spec.base.name!r}, which this fleet does "
                                  f"not serve (it serves: {', '.join(bases)})")
            candidate = _entry(info, spec.base.name, spec.profile, "promote", spec)
            preloaded = await _preload(nc, kv, candidate, target, preload) if preload.enabled else None
            try:
                await lock.verify()
                fresh = await _snapshot(kv, name)
                reached("read")
                if fresh.key() != state.key() or fresh.entry is None:
                    raise split.error(f"{name} changed while the preload ran (was: {state.describe()}; now: "
                                      f"{fresh.describe()}); nothing changed. Run it again")
                entry = split.place(fresh.entry, candidate)
                await write_fleet(lock, kv, entry, fresh.revision)
            finally:
                if preloaded is not None:
                    with contextlib.suppress(Exception):
                        await delete_staged(kv, name)
    return entry, verdict


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


__all__ = ["Change", "Split", "connected", "finished_by_repair", "locked", "rewrite", "start_split"]
