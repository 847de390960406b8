"""What the registry and the fleet say about one name, read together, and the repair when they disagree.

The registry alias is the record of intent; the fleet entry and the history follow it. A process that died
between moving the alias and writing the entry leaves them disagreeing: every promote, rollback and
`check(repair=True)` (`lorafleet registry check NAME --repair`) finds that and republishes the alias's version
first, unless the fleet entry lists that version as retired (an aborted canary, a version taken out): then the
alias goes back to what the fleet serves, so a repair never brings a version back that was taken out.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from lorafleet.core.fleet_state import FleetEntry, Retention, read_entry, with_retention
from lorafleet.registry import store
from lorafleet.registry.gate import PromotionError
from lorafleet.registry.lock import HeldLock
from lorafleet.registry.staging import version_entry
from lorafleet.registry.store import CHAMPION
from lorafleet.registry.writes import in_thread, write_alias, write_fleet, write_history

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Agreement:
    """The champion alias, its history and the version the fleet serves under one name, as read together.

    They agree when the fleet serves the champion and the history ends with it (or there is no champion).
    `revision` is the live entry's last revision in the fleet bucket: the compare-and-set of the next write."""

    name: str
    champion: str | None
    served: str | None  # the live entry's version; None: no entry
    history: tuple[str, ...]
    revision: int = 0
    repaired: bool = False  # this is the state after a repair of a disagreement
    # The live entry as read (its retained versions carry over to the next write); not part of key(): the revision
    # already says whether it changed.
    entry: FleetEntry | None = field(default=None, compare=False)
    before: Agreement | None = field(default=None, compare=False)  # after a repair: the disagreement it repaired

    @property
    def agrees(self) -> bool:
        return self.champion is None or (self.served == self.champion and self.history[-1:] == (self.champion,))

    def key(self) -> tuple[object, ...]:
        return self.champion, self.served, self.history, self.revision

    def describe(self) -> str:
        served = f"v{self.served}" if self.served else "nothing"
        champion = f"v{self.champion}" if self.champion else "none"
        return f"champion {champion}, fleet serves {served}, history {','.join(self.history) or '-'}"


def repaired_history(history: tuple[str, ...], champion: str) -> tuple[str, ...]:
    """The history that ends with `champion`: cut after its last entry (a rollback that died before trimming), or
    with it appended (a promotion that died before recording it)."""
    if champion in history:
        return history[: len(history) - history[::-1].index(champion)]
    return (*history, champion)


def history_with(history: tuple[str, ...], version: str) -> tuple[str, ...]:
    """The champion history once `version` is champion: as it is when it already ends with it, else with it added."""
    return history if history[-1:] == (version,) else (*history, version)


def rollback_target(name: str, champion: str | None, history: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """The version a rollback returns to and the history after it."""
    if champion is None:
        raise PromotionError(f"{name} has no champion to roll back from (promote a version first)")
    trimmed = list(history)
    while trimmed and trimmed[-1] == champion:
        trimmed.pop()
    if not trimmed:
        raise PromotionError(f"{name}: champion v{champion} has no previous champion to roll back to")
    return trimmed[-1], tuple(trimmed)


async def snapshot(kv: object, name: str) -> Agreement:
    champion = await in_thread(store.alias_version, name, CHAMPION)
    history = tuple(await in_thread(store.champion_history, name))
    entry, revision = await read_entry(kv, name)
    return Agreement(name, champion, entry.version if entry is not None else None, history, revision, entry=entry)


def taken_out(state: Agreement) -> bool:
    """Whether the alias names a version the fleet entry lists as retired (an aborted canary, a version taken out)
    while the fleet serves another: a repair must not bring it back, the alias follows the fleet instead."""
    return (state.entry is not None and state.champion is not None and state.served is not None
            and state.champion != state.served and state.champion in state.entry.retired)


async def repair(kv: object, state: Agreement, retention: Retention | None = None, lock: HeldLock | None = None
                  ) -> Agreement:
    """Make the fleet entry and the history follow the alias (under the name's lock); the version it replaces is
    retained like a promote's (pinned clients of it keep working). When the alias names a version the fleet took
    out (`taken_out`), the alias and history follow the fleet instead."""
    assert state.champion is not None  # agrees otherwise
    revision = state.revision
    entry = state.entry
    if taken_out(state):
        assert state.served is not None
        history = repaired_history(state.history, state.served)
        await write_alias(lock, state.name, state.served)
        if history != state.history:
            await write_history(lock, state.name, history)
        log.warning("%s: repaired the disagreement %s: the alias names v%s, which the fleet took out; it follows "
                    "the fleet again", state.name, state.describe(), state.champion)
        return dataclasses.replace(state, champion=state.served, history=history, repaired=True, before=state)
    if state.served != state.champion:
        info, spec = await in_thread(store.bundle_spec, state.name, state.champion)
        entry = with_retention(state.entry, version_entry(info, spec.base.name, spec.profile, "set", spec),
                               retention or Retention(), time.time())
        revision = await write_fleet(lock, kv, entry, revision)
    history = repaired_history(state.history, state.champion)
    if history != state.history:
        await write_history(lock, state.name, history)
    log.warning("%s: repaired the disagreement %s", state.name, state.describe())
    return dataclasses.replace(state, served=state.champion, history=history, revision=revision, repaired=True,
                               entry=entry, before=state)


__all__ = ["Agreement", "history_with", "repair", "repaired_history", "rollback_target", "snapshot",
           "taken_out"]
