"""Promotion and rollback: quality gate → alias `champion` → desired fleet state on NATS, live.

The gate (registry/gate.py) is the task kind's; the cluster is found and reached through registry/fleet_target.py;
the version's entry is staged and preloaded on the workers of its base first (registry/staging.py); what the
registry and the fleet say about the name is read, and repaired when they disagree, by registry/consistency.py.

Order matters for "nothing changed on error": everything that can fail for a reason the user must
fix (unknown version, failing gate, base not served, NATS or the KV bucket unreachable) is checked
before the alias moves; if the KV write still fails, the alias is moved back.

Concurrency (issue 23): a promotion or rollback of NAME holds NAME's lock in the fleet bucket
(registry/lock.py) from before it reads the champion until it has written the fleet state, so a second one
is refused at once ("another promote of NAME is in progress"). Under the lock it reads the champion, its
history and the live entry (with its revision) again, gates against that champion, preloads, reads all of it
once more (anything changed meanwhile: nothing changes) and writes the entry by compare-and-set on that
revision. The registry alias is the record of intent; the fleet entry and the history follow it.

Interruption (issue 38): every write goes through registry/writes.py, which checks the lock before it (a holder
that stalled past the lock's TTL writes nothing more), and resolves a failed fleet write by reading it back. An
interruption (Ctrl-C, SIGTERM, a cancellation) after the alias moved undoes the alias and history unless the
fleet write is read back as stored; the undo is compare-then-set (only what this switch wrote, and only while it
still holds the lock), so it never writes over a newer change.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lorafleet.core.fleet_state import FleetEntry, Retention, refuse_during_canary, with_retention
from lorafleet.core.tasks import GateResult
from lorafleet.registry import consistency, store
from lorafleet.registry.consistency import (
    Agreement,
    history_with,
    repaired_history,
    rollback_target,
    snapshot,
    taken_out,
)
from lorafleet.registry.fleet_target import (
    FleetTarget,
    connect,
    control_client,
    find_fleet,
    fleet_bases,
    open_fleet,
    target_of,
    target_retention,
)
from lorafleet.registry.gate import (
    MARGIN_ENV,
    PromotionError,
    check_gate,
    default_margin,
    gate_margin,
    gate_or_refuse,
    gated_candidate,
)
from lorafleet.registry.lock import HeldLock, LockLost, locked
from lorafleet.registry.precision_notice import HeartbeatListener, PrecisionNotice, judged_of
from lorafleet.registry.preload import PreloadResult
from lorafleet.registry.staging import Preload, served_entry, staged, version_entry
from lorafleet.registry.store import CHAMPION, VersionInfo
from lorafleet.registry.writes import in_thread, reached, run_transition, write_alias, write_fleet, write_history

log = logging.getLogger(__name__)

# The names this module had before the gate, the target, staging and consistency moved out (tests and tools
# import them from here).
_connect, _entry, _target = connect, version_entry, target_of


@dataclass
class Outcome:
    name: str
    version: str
    previous: str | None
    action: Literal["promote", "rollback"]
    entry: FleetEntry
    gate: GateResult | None
    nats_url: str
    preload: PreloadResult | None = None  # None: --no-preload
    repaired: Agreement | None = None  # the disagreement found (and repaired) before switching
    precision: PrecisionNotice | None = None  # the tuned precision against what the base's workers serve (issue 27)


# Given the state read under the lock: the version to publish, the champion history after it, the gate's verdict.
Decide = Callable[[Agreement], tuple[VersionInfo, tuple[str, ...], GateResult | None]]


@dataclass(frozen=True)
class _Switched:
    entry: FleetEntry
    preload: PreloadResult | None
    gate: GateResult | None
    previous: str | None
    repaired: Agreement | None
    precision: PrecisionNotice | None = None


async def _undo(lock: HeldLock, name: str, version: str, history: tuple[str, ...], before: Agreement) -> None:
    """Put alias and history back as read, compare-then-set: only while this switch still holds the lock, and
    only when the alias and the history show this switch's writes (or the history is still as read). Anything
    else is a newer change, never overwritten."""
    try:
        await lock.verify()
    except LockLost as exc:
        log.warning("%s: not undoing the switch to v%s: %s", name, version, exc)
        return
    if await in_thread(store.alias_version, name, CHAMPION) != version:
        return
    now = tuple(await in_thread(store.champion_history, name))
    if now not in (history, before.history):
        log.warning("%s: not undoing the switch to v%s: the history changed meanwhile (%s)", name, version,
                    ",".join(now))
        return
    if before.champion != version:
        await write_alias(lock, name, before.champion)
    if now != before.history:
        await write_history(lock, name, before.history)


async def _undo_quietly(lock: HeldLock, name: str, version: str, history: tuple[str, ...], before: Agreement
                        ) -> None:
    try:
        await _undo(lock, name, version, history, before)
    except BaseException as exc:  # the failure that led here is the one to raise
        log.error("%s: undoing the switch to v%s failed (%r): run `lorafleet registry check %s --repair`", name,
                  version, exc, name)


async def _switch_locked(nc: object, kv: object, lock: HeldLock, target: FleetTarget, bases: list[str], name: str,
                         action: Literal["promote", "rollback"], decide: Decide, preload: Preload) -> _Switched:
    say = preload.progress or log.info
    state = await snapshot(kv, name)
    found = None
    if not state.agrees:
        found = state
        say(f"{name}: the registry and the fleet disagree ({state.describe()}): the fleet state follows the "
            "champion alias again first")
        state = await consistency.repair(kv, state, target.retention, lock)
    await lock.verify()  # the repair and the reads took a while
    info, history, gate = await in_thread(decide, state)
    entry = await served_entry(info, bases, action, PromotionError, "; add the base to the fleet first")
    async with staged(nc, kv, entry, target, preload) as preloaded:
        await lock.verify()
        fresh = await snapshot(kv, name)  # the preload took a while: decide on what is true now
        reached("read")
        if fresh.key() != state.key():
            raise PromotionError(f"{name} changed while the preload ran (was: {state.describe()}; now: "
                                 f"{fresh.describe()}); nothing changed. Run it again")
        # The champion it replaces stays served as NAME@N for the retention window (issue 25): carried in the
        # entry written by this compare-and-set, so every gateway agrees and a restart keeps it.
        entry = with_retention(fresh.entry, entry, target.retention, time.time())
        # Each write checks the lock first (registry/writes.py). An interruption of any kind after the alias moved
        # undoes what this switch wrote (compare-then-set), unless it lost the lock: then the next holder is in
        # charge, and a repair of its own makes the stores agree.
        try:
            await write_alias(lock, name, info.version)
            await write_history(lock, name, history)
        except LockLost:
            raise
        except BaseException:
            await _undo_quietly(lock, name, info.version, history, fresh)
            raise
        await write_fleet(lock, kv, entry, fresh.revision,
                          undo=lambda: _undo(lock, name, info.version, history, fresh))
    return _Switched(entry, preloaded, gate, state.champion, found)


async def _switch(target: FleetTarget, name: str, action: Literal["promote", "rollback"], decide: Decide,
                  preload: Preload) -> _Switched:
    async with open_fleet(target.nats_url, target.client) as (nc, kv):
        listener = await HeartbeatListener().start(nc)  # what the base's workers serve at, for the notice
        bases = await fleet_bases(nc, target)
        async with locked(kv, name, action, PromotionError) as lock:
            done = await _switch_locked(nc, kv, lock, target, bases, name, action, decide, preload)
        notice = await listener.notice(done.entry.base, judged_of(done.entry), target.heartbeat_s,
                                       target.precisions.get(done.entry.base))
        await listener.close()
        return dataclasses.replace(done, precision=notice)


def switch(target: FleetTarget, name: str, action: Literal["promote", "rollback"], decide: Decide,
           preload: Preload | None = None) -> Outcome:
    """Switch `name` to what `decide` picks under its lock (see the module docstring), as one transition."""
    done = run_transition(_switch(target, name, action, decide, preload or Preload()))
    return Outcome(name, done.entry.version, done.previous, action, done.entry, done.gate, target.nats_url,
                   done.preload, done.repaired, done.precision)


def promote(name: str, version: str | int | None = None, *, force: bool = False, margin: float | None = None,
            nats_url: str | None = None, fleet_file: Path | None = None, creds: Path | None = None,
            preload: Preload | None = None, retention: Retention | None = None,
            retention_changes: dict[str, float | int | None] | None = None) -> Outcome:
    """Gate, preload on the workers of its base, move `champion` to the version (default: the `candidate` alias,
    else the newest), publish live. The gate runs once before connecting (a refusal needs no cluster) and again
    under the name's lock, against the champion as it is then. The champion it replaces stays served as NAME@N
    for `retention` (default: the fleet file's gateway.retain_s / retain_versions)."""
    info, margin = gated_candidate(name, version, margin, force)
    target = target_retention(find_fleet(nats_url, fleet_file, creds), retention, retention_changes)

    def decide(state: Agreement) -> tuple[VersionInfo, tuple[str, ...], GateResult | None]:
        refuse_during_canary(state.entry)  # a canary holds the name until --finish/--abort (registry/canary.py)
        gate = gate_or_refuse(info, state.champion, margin, force)
        return info, history_with(state.history, info.version), gate

    return switch(target, name, "promote", decide, preload)


def rollback(name: str, *, nats_url: str | None = None, fleet_file: Path | None = None,
             creds: Path | None = None, preload: Preload | None = None, retention: Retention | None = None,
             retention_changes: dict[str, float | int | None] | None = None) -> Outcome:
    """Move `champion` back to the version that held it before, and publish that live (after a preload that
    goes ahead on timeout)."""
    rollback_target(name, store.alias_version(name, CHAMPION), tuple(store.champion_history(name)))  # fail early
    target = target_retention(find_fleet(nats_url, fleet_file, creds), retention, retention_changes)

    def decide(state: Agreement) -> tuple[VersionInfo, tuple[str, ...], GateResult | None]:
        refuse_during_canary(state.entry)
        version, history = rollback_target(name, state.champion, state.history)
        return store.get_version(name, version), history, None

    return switch(target, name, "rollback", decide, preload)


def check(name: str, *, nats_url: str | None = None, fleet_file: Path | None = None, creds: Path | None = None,
          repair: bool = False) -> Agreement:
    """Whether the champion alias, its history and the fleet state of `name` agree; with `repair`, make the fleet
    state and history follow the alias (under the name's lock) when they do not."""
    store.versions(name)  # an unknown name is the registry's error, not a disagreement
    target = find_fleet(nats_url, fleet_file, creds)

    async def run() -> Agreement:
        async with open_fleet(target.nats_url, target.client) as (_, kv):
            state = await snapshot(kv, name)
            if state.agrees or not repair:
                return state
            async with locked(kv, name, "repair", PromotionError) as lock:
                state = await snapshot(kv, name)
                reached("read")
                return state if state.agrees else await consistency.repair(kv, state, target.retention, lock)

    return run_transition(run())


__all__ = ["MARGIN_ENV", "Agreement", "FleetTarget", "Outcome", "Preload", "PromotionError", "check", "check_gate",
           "control_client", "default_margin", "find_fleet", "gate_margin", "promote", "repaired_history", "rollback",
           "rollback_target", "switch", "taken_out"]
