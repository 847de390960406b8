"""Promotion and rollback: quality gate → alias `champion` → desired fleet state on NATS, live.

The gate is the task kind's (`lorafleet.core.tasks.judge`, the same one research's verdict uses): the
version's headline metric (test nDCG@10 for retrieval) must beat, strictly, what its kind compares with
(the base model's, or the kind's best baseline and rivals) by a relative margin, and must not fall
behind the current champion's. The margin is the one research judged the version by (recorded in its
bundle), unless `--margin` or LORAFLEET_PROMOTE_MARGIN gives another.

Order matters for "nothing changed on error": everything that can fail for a reason the user must
fix (unknown version, failing gate, base not served, NATS or the KV bucket unreachable) is checked
before the alias moves; if the KV write still fails, the alias is moved back.

Preload (registry/preload.py): before the alias moves, the new version is staged and every live worker of
its base loads it; the fleet switches only once all have confirmed. A worker that does not confirm within
the timeout fails a promotion (nothing changed: the fleet would otherwise switch to a version some workers
could not load, and its first requests there would wait for the download); a rollback, which is urgent,
goes ahead and says which workers did not confirm.

Concurrency (issue 23): a promotion or rollback of NAME holds NAME's lock in the fleet bucket
(registry/lock.py) from before it reads the champion until it has written the fleet state, so a second one
is refused at once ("another promote of NAME is in progress"). Under the lock it reads the champion, its
history and the live entry (with its revision) again, gates against that champion, preloads, reads all of it
once more (anything changed meanwhile: nothing changes) and writes the entry by compare-and-set on that
revision. The registry alias is the record of intent; the fleet entry and the history follow it. A process
that died between moving the alias and writing the entry leaves them disagreeing: every promote, rollback
and `check(repair=True)` (`lorafleet registry check NAME --repair`) finds that and republishes the alias's
version first, unless the fleet entry lists that version as retired (an aborted canary, a version taken out):
then the alias goes back to what the fleet serves, so a repair never brings a version back that was taken out.

Interruption (issue 38): every write goes through registry/writes.py, which checks the lock before it (a holder
that stalled past the lock's TTL writes nothing more), and resolves a failed fleet write by reading it back. An
interruption (Ctrl-C, SIGTERM, a cancellation) after the alias moved undoes the alias and history unless the
fleet write is read back as stored; the undo is compare-then-set (only what this switch wrote, and only while it
still holds the lock), so it never writes over a newer change.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lorafleet.core import heartbeats, settings
from lorafleet.core.config import FleetConfig, ServingProfile, load_yaml_model
from lorafleet.core.fleet_state import (
    FleetEntry,
    FleetStateError,
    Retention,
    adapter_id_for,
    delete_staged,
    open_fleet_bucket,
    put_staged,
    read_entry,
    refuse_during_canary,
    with_retention,
)
from lorafleet.core.refs import version_uri
from lorafleet.core.tasks import DEFAULT_MARGIN, GateResult, get_task_kind
from lorafleet.nats.auth import CREDS_SUFFIX, explain_connect_error
from lorafleet.nats.client import RECONNECT_OPTIONS, ClientSettings, server_urls
from lorafleet.nats.server import port_open
from lorafleet.ops.cluster import ClusterError, ClusterState
from lorafleet.registry import store
from lorafleet.registry.bundle import MARGIN_TAG, BundleSpec
from lorafleet.registry.lock import HeldLock, LockBusy, LockLost, promote_lock
from lorafleet.registry.precision_notice import HeartbeatListener, PrecisionNotice, judged_of, judged_profile
from lorafleet.registry.preload import DEFAULT_PRELOAD_TIMEOUT_S, PreloadResult, wait_preloaded
from lorafleet.registry.store import CANDIDATE, CHAMPION, VersionInfo
from lorafleet.registry.writes import in_thread, reached, run_transition, write_alias, write_fleet, write_history

MARGIN_ENV = "LORAFLEET_PROMOTE_MARGIN"

log = logging.getLogger(__name__)


class PromotionError(RuntimeError):
    """Promotion or rollback refused; nothing was changed. The message says why and what to do."""


def default_margin() -> float | None:
    """The operator's margin from LORAFLEET_PROMOTE_MARGIN (0.02 = 2 %); None when it is not set, and the gate then
    uses the margin the version records (`gate_margin`)."""
    raw = os.environ.get(MARGIN_ENV)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError as exc:
        raise PromotionError(f"{MARGIN_ENV}={raw!r} is not a number") from exc
    if not value >= 0:
        raise PromotionError(f"{MARGIN_ENV}={raw!r} must be a relative margin ≥ 0 (0.02 = 2 %)")
    return value


def gate_margin(candidate: VersionInfo, margin: float | None) -> tuple[float, str]:
    """The margin the gate uses and where it came from: the one given (`--margin`, LORAFLEET_PROMOTE_MARGIN), else
    the one research judged the version by (recorded in its bundle and tag), else DEFAULT_MARGIN (research's
    default, for versions registered without one)."""
    if margin is not None:
        return margin, "given"
    raw = candidate.tags.get(MARGIN_TAG)
    if raw is not None:
        try:
            return float(raw), "recorded by research"
        except ValueError:
            pass
    return DEFAULT_MARGIN, "default"


def check_gate(candidate: VersionInfo, champion: VersionInfo | None, margin: float | None = None) -> GateResult:
    """Pure apart from the plugin lookup: the candidate's task kind judges it against base and champion.

    `margin` None: the one research recorded for the version (gate_margin). Beating means strictly better by the
    margin (a tie is no win). Test numbers measured on different datasets say nothing about each other: when both
    versions record their dataset digest and the digests differ, the comparison with the champion is refused (the
    gate fails; the base comparison, made on the candidate's own test set, still counts). A version without a
    digest (older registries) is compared as before."""
    margin, source = gate_margin(candidate, margin)
    return dataclasses.replace(_judge(candidate, champion, margin), margin_source=source)


def _judge(candidate: VersionInfo, champion: VersionInfo | None, margin: float) -> GateResult:
    kind = get_task_kind(candidate.task)
    mine = candidate.dataset_digest
    theirs = champion.dataset_digest if champion is not None else None
    if champion is not None and champion.version != candidate.version and mine and theirs and mine != theirs:
        alone = kind.gate(candidate.metrics(), None, margin, candidate_label=f"version {candidate.version}")
        why = (f"v{candidate.version} was scored on dataset {mine[:12]}, the champion v{champion.version} on dataset "
               f"{theirs[:12]}: their {alone.metric} numbers are not comparable. Re-evaluate the champion on "
               f"v{candidate.version}'s dataset (train it again on that data) or promote with --force")
        return dataclasses.replace(alone, ok=False, reasons=[*alone.reasons, why])
    return kind.gate(candidate.metrics(), champion.metrics() if champion is not None else None, margin,
                     candidate_label=f"version {candidate.version}",
                     champion_label=f"the champion v{champion.version}" if champion is not None else "the champion")


# -- finding the fleet ----------------------------------------------------------------------------

@dataclass
class FleetTarget:
    nats_url: str
    bases: list[str] | None  # None: learnt from worker heartbeats when connected
    source: str
    client: ClientSettings = field(default_factory=ClientSettings)  # control: writing the fleet bucket is its job
    heartbeat_s: float = 1.0  # the workers' heartbeat period (the fleet file's), for how long preload listens
    retention: Retention = field(default_factory=Retention)  # the fleet file's gateway.retain_s/retain_versions
    precisions: dict[str, str] = field(default_factory=dict)  # base → the fleet file's `precision:` (issue 39)


@dataclass(frozen=True)
class Preload:
    """Whether and how long a promotion waits for the workers of the base to load the new version first."""

    enabled: bool = True
    timeout_s: float = DEFAULT_PRELOAD_TIMEOUT_S
    progress: Callable[[str], None] | None = None  # progress lines (the CLI prints them); default: the log


def control_client(state: ClusterState | None = None, creds: Path | None = None) -> ClientSettings:
    """`creds`, else LORAFLEET_NATS_CREDS (and the TLS variables), else LORAFLEET_HOME/creds/control.nk; the
    cluster's CA unless one is set."""
    client = ClientSettings.resolve(creds=creds, fallback_creds=settings.home() / "creds" / f"control{CREDS_SUFFIX}")
    if client.tls is None and state is not None and state.tls:
        client = ClientSettings(client.creds, state.client(None).tls)
    return client


def find_fleet(nats_url: str | None = None, fleet_file: Path | None = None, creds: Path | None = None
               ) -> FleetTarget:
    """The cluster to publish to: --nats-url (and --fleet) if given, else LORAFLEET_HOME/cluster.json."""
    fleet: FleetConfig | None = None
    if fleet_file is not None:
        fleet = load_yaml_model(FleetConfig, fleet_file)
    if nats_url:
        return _target(nats_url, fleet, "--nats-url", control_client(creds=creds))
    try:
        state = ClusterState.load(settings.home())
    except ClusterError as exc:
        raise PromotionError(f"{exc}; or name a running cluster with --nats-url") from exc
    if fleet is None:
        with contextlib.suppress(Exception):
            fleet = load_yaml_model(FleetConfig, state.fleet_file)
    return _target(state.nats_url, fleet, str(settings.home() / "cluster.json"), control_client(state, creds))


def _target(url: str, fleet: FleetConfig | None, source: str, client: ClientSettings) -> FleetTarget:
    if fleet is None:
        return FleetTarget(url, None, source, client)
    return FleetTarget(url, [b.name for b in fleet.bases], source, client, fleet.worker.heartbeat_s,
                       Retention(fleet.gateway.retain_s, fleet.gateway.retain_versions),
                       {b.name: b.precision for b in fleet.bases})


async def _heartbeat_bases(nc: object, wait_s: float = 2.5) -> list[str]:
    """The bases that live workers serve, from the first heartbeat(s) heard within `wait_s`."""
    seen = await heartbeats.collect(nc, wait_s, until=bool)
    return sorted({b for hb in seen.values() for b in hb.bases})


async def _connect(url: str, client: ClientSettings | None = None, *, lasting: bool = False) -> object:
    """A NATS connection that fails fast: nats-py keeps retrying a refused first connect on its own. `lasting`
    (the canary watch, which guards for minutes): the gateway's and workers' pings and reconnects
    (RECONNECT_OPTIONS), so a server that goes silent is noticed within seconds and another node taken."""
    from urllib.parse import urlsplit

    import nats

    # A cluster's URL lists its nodes: connect to one that listens.
    servers = [u for u in server_urls(url)
               if port_open(urlsplit(u).hostname or "127.0.0.1", urlsplit(u).port or 4222, timeout=2.0)]
    if not servers:
        raise FleetStateError(f"cannot reach nats-server at {url}: nothing listens there (is the cluster up?)")

    async def _quiet(exc: Exception) -> None:
        return None

    options = (client or ClientSettings()).options()
    keep = {"allow_reconnect": True, **RECONNECT_OPTIONS} if lasting else \
        {"allow_reconnect": False, "max_reconnect_attempts": 0}
    try:
        return await asyncio.wait_for(nats.connect(servers, connect_timeout=3, error_cb=_quiet, **keep, **options),
                                      timeout=6.0)
    except Exception as exc:
        raise FleetStateError(explain_connect_error(exc, url)) from exc


# -- what the registry and the fleet say about one name ------------------------------------------

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


async def _snapshot(kv: object, name: str) -> Agreement:
    champion = await in_thread(store.alias_version, name, CHAMPION)
    history = tuple(await in_thread(store.champion_history, name))
    entry, revision = await read_entry(kv, name)
    return Agreement(name, champion, entry.version if entry is not None else None, history, revision, entry=entry)


def taken_out(state: Agreement) -> bool:
    """Whether the alias names a version the fleet entry lists as retired (an aborted canary, a version taken out)
    while the fleet serves another: a repair must not bring it back, the alias follows the fleet instead."""
    return (state.entry is not None and state.champion is not None and state.served is not None
            and state.champion != state.served and state.champion in state.entry.retired)


async def _repair(kv: object, state: Agreement, retention: Retention | None = None, lock: HeldLock | None = None
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
        entry = with_retention(state.entry, _entry(info, spec.base.name, spec.profile, "set", spec),
                               retention or Retention(), time.time())
        revision = await write_fleet(lock, kv, entry, revision)
    history = repaired_history(state.history, state.champion)
    if history != state.history:
        await write_history(lock, state.name, history)
    log.warning("%s: repaired the disagreement %s", state.name, state.describe())
    return dataclasses.replace(state, served=state.champion, history=history, revision=revision, repaired=True,
                               entry=entry, before=state)


# -- promote / rollback ---------------------------------------------------------------------------

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


def _entry(info: VersionInfo, base: str, profile: ServingProfile | None,
           action: Literal["promote", "rollback", "set"], spec: BundleSpec | None = None) -> FleetEntry:
    details = spec.details if spec is not None else {}
    generation = details.get("generation")
    return FleetEntry(name=info.name, base=base, adapter_id=adapter_id_for(info.name, info.version),
                      adapter_uri=version_uri(info.name, info.version), profile=judged_profile(profile, spec),
                      version=info.version, registered_model=info.name, action=action,
                      kind=spec.kind if spec is not None else None,
                      system_prompt=details.get("system_prompt") or None,
                      chat_template=details.get("chat_template") or None,
                      generation=generation if isinstance(generation, dict) else None)


async def _preload(nc: object, kv: object, entry: FleetEntry, target: FleetTarget, preload: Preload
                   ) -> PreloadResult:
    """Stage the entry, wait for the workers of its base; PromotionError (staged key removed) when a promotion's
    workers do not all confirm in time."""
    say = preload.progress or log.info
    try:
        result = await wait_preloaded(nc, entry.base, entry.adapter_id, timeout_s=preload.timeout_s,
                                      heartbeat_s=target.heartbeat_s, progress=say,
                                      started=lambda: put_staged(kv, entry))
    except Exception as exc:
        with contextlib.suppress(Exception):
            await delete_staged(kv, entry.name)
        raise FleetStateError(f"staging {entry.adapter_id} for preload failed, nothing changed: {exc}") from exc
    if not result.workers:
        say(f"no live worker of base {entry.base} heard: nothing to preload")
    elif result.complete:
        say(f"preloaded {entry.adapter_id} on {len(result.workers)} worker(s) in {result.seconds:.1f}s")
    else:
        why = (f"{len(result.missing)} of {len(result.workers)} worker(s) of base {entry.base} did not confirm "
               f"loading {entry.adapter_id} within {preload.timeout_s:g}s: {', '.join(result.missing)}")
        if entry.action == "promote":
            with contextlib.suppress(Exception):
                await delete_staged(kv, entry.name)
            raise PromotionError(f"{why}; nothing changed. Their logs say why (download or load failure); "
                                 "raise --preload-timeout, or pass --no-preload to switch without waiting")
        say(f"{why}; switching anyway (a rollback does not wait): their first requests load it on demand")
    return result


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
    state = await _snapshot(kv, name)
    found = None
    if not state.agrees:
        found = state
        say(f"{name}: the registry and the fleet disagree ({state.describe()}): the fleet state follows the "
            "champion alias again first")
        state = await _repair(kv, state, target.retention, lock)
    await lock.verify()  # the repair and the reads took a while
    info, history, gate = await in_thread(decide, state)
    _, spec = await in_thread(store.bundle_spec, info.name, info.version)
    if spec.base.name not in bases:
        raise PromotionError(f"{info.name} v{info.version} runs on base {spec.base.name!r}, which this fleet "
                             f"does not serve (it serves: {', '.join(bases)}); add the base to the fleet first")
    entry = _entry(info, spec.base.name, spec.profile, action, spec)
    preloaded = await _preload(nc, kv, entry, target, preload) if preload.enabled else None
    try:
        await lock.verify()
        fresh = await _snapshot(kv, name)  # the preload took a while: decide on what is true now
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
    finally:
        if preloaded is not None:
            with contextlib.suppress(Exception):  # workers ignore a stale one: the adapter is loaded
                await delete_staged(kv, entry.name)
    return _Switched(entry, preloaded, gate, state.champion, found)


async def _bases(nc: object, target: FleetTarget) -> list[str]:
    bases = target.bases if target.bases is not None else await _heartbeat_bases(nc)
    if not bases:
        raise PromotionError("cannot tell which base models the fleet serves: no fleet file and no worker "
                             "heartbeat; pass --fleet FLEET.yaml")
    return bases


async def _switch(target: FleetTarget, name: str, action: Literal["promote", "rollback"], decide: Decide,
                  preload: Preload) -> _Switched:
    nc = await _connect(target.nats_url, target.client)
    try:
        kv = await open_fleet_bucket(nc.jetstream())  # type: ignore[attr-defined]
        listener = await HeartbeatListener().start(nc)  # what the base's workers serve at, for the notice
        bases = await _bases(nc, target)
        try:
            async with promote_lock(kv, name, action) as lock:
                done = await _switch_locked(nc, kv, lock, target, bases, name, action, decide, preload)
        except (LockBusy, LockLost) as exc:
            raise PromotionError(str(exc)) from exc
        notice = await listener.notice(done.entry.base, judged_of(done.entry), target.heartbeat_s,
                                       target.precisions.get(done.entry.base))
        await listener.close()
        return dataclasses.replace(done, precision=notice)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()  # type: ignore[attr-defined]


def _with_retention(target: FleetTarget, retention: Retention | None,
                    changes: dict[str, float | int | None] | None = None) -> FleetTarget:
    """`retention` replaces the fleet file's; `changes` (`--retain`, `--retain-versions`) replace single fields."""
    chosen = retention if retention is not None else target.retention
    return dataclasses.replace(target, retention=dataclasses.replace(chosen, **(changes or {})))  # type: ignore[arg-type]


def _gate_or_refuse(info: VersionInfo, champion: str | None, margin: float | None, force: bool) -> GateResult:
    gate = check_gate(info, store.get_version(info.name, champion) if champion is not None else None, margin)
    if not gate.ok and not force:
        raise PromotionError(f"{info.name} v{info.version} fails the quality gate: " + "; ".join(gate.reasons)
                             + " (use --force to promote anyway)")
    return gate


def promote(name: str, version: str | int | None = None, *, force: bool = False, margin: float | None = None,
            nats_url: str | None = None, fleet_file: Path | None = None, creds: Path | None = None,
            preload: Preload | None = None, retention: Retention | None = None,
            retention_changes: dict[str, float | int | None] | None = None) -> Outcome:
    """Gate, preload on the workers of its base, move `champion` to the version (default: the `candidate` alias,
    else the newest), publish live. The gate runs once before connecting (a refusal needs no cluster) and again
    under the name's lock, against the champion as it is then. The champion it replaces stays served as NAME@N
    for `retention` (default: the fleet file's gateway.retain_s / retain_versions)."""
    margin = default_margin() if margin is None else margin
    if version is None:
        version = store.alias_version(name, CANDIDATE)
    info = store.get_version(name, version)
    _gate_or_refuse(info, store.alias_version(name, CHAMPION), margin, force)
    target = _with_retention(find_fleet(nats_url, fleet_file, creds), retention, retention_changes)

    def decide(state: Agreement) -> tuple[VersionInfo, tuple[str, ...], GateResult | None]:
        refuse_during_canary(state.entry)  # a canary holds the name until --finish/--abort (registry/canary.py)
        gate = _gate_or_refuse(info, state.champion, margin, force)
        history = state.history if state.history[-1:] == (info.version,) else (*state.history, info.version)
        return info, history, gate

    done = run_transition(_switch(target, name, "promote", decide, preload or Preload()))
    return Outcome(name, info.version, done.previous, "promote", done.entry, done.gate, target.nats_url,
                   done.preload, done.repaired, done.precision)


def rollback(name: str, *, nats_url: str | None = None, fleet_file: Path | None = None,
             creds: Path | None = None, preload: Preload | None = None, retention: Retention | None = None,
             retention_changes: dict[str, float | int | None] | None = None) -> Outcome:
    """Move `champion` back to the version that held it before, and publish that live (after a preload that
    goes ahead on timeout)."""
    rollback_target(name, store.alias_version(name, CHAMPION), tuple(store.champion_history(name)))  # fail early
    target = _with_retention(find_fleet(nats_url, fleet_file, creds), retention, retention_changes)

    def decide(state: Agreement) -> tuple[VersionInfo, tuple[str, ...], GateResult | None]:
        refuse_during_canary(state.entry)
        version, history = rollback_target(name, state.champion, state.history)
        return store.get_version(name, version), history, None

    done = run_transition(_switch(target, name, "rollback", decide, preload or Preload()))
    return Outcome(name, done.entry.version, done.previous, "rollback", done.entry, None, target.nats_url,
                   done.preload, done.repaired, done.precision)


def check(name: str, *, nats_url: str | None = None, fleet_file: Path | None = None, creds: Path | None = None,
          repair: bool = False) -> Agreement:
    """Whether the champion alias, its history and the fleet state of `name` agree; with `repair`, make the fleet
    state and history follow the alias (under the name's lock) when they do not."""
    store.versions(name)  # an unknown name is the registry's error, not a disagreement
    target = find_fleet(nats_url, fleet_file, creds)

    async def run() -> Agreement:
        nc = await _connect(target.nats_url, target.client)
        try:
            kv = await open_fleet_bucket(nc.jetstream())  # type: ignore[attr-defined]
            state = await _snapshot(kv, name)
            if state.agrees or not repair:
                return state
            try:
                async with promote_lock(kv, name, "repair") as lock:
                    state = await _snapshot(kv, name)
                    reached("read")
                    return state if state.agrees else await _repair(kv, state, target.retention, lock)
            except (LockBusy, LockLost) as exc:
                raise PromotionError(str(exc)) from exc
        finally:
            with contextlib.suppress(Exception):
                await nc.close()  # type: ignore[attr-defined]

    return run_transition(run())
