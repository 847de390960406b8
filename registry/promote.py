"""Promotion and rollback: quality gate → alias `champion` → desired fleet state on NATS, live.

Order matters for "nothing changed on error": everything that can fail for a reason the user must
fix (unknown version, failing gate, base not served, NATS or the KV bucket unreachable) is checked
before the alias moves; if the KV write still fails, the alias is moved back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lorafleet import settings
from lorafleet.config import ServingProfile
from lorafleet.registry import store
from lorafleet.registry.fleet_state import (
    FleetEntry,
    FleetStateError,
    adapter_id_for,
    open_fleet_bucket,
    put_entry,
)
from lorafleet.registry.store import CANDIDATE, CHAMPION, VersionInfo

GATE_METRIC = "test_ndcg@10"
BASE_METRIC = "base_test_ndcg@10"
DEFAULT_MARGIN = 0.0
MARGIN_ENV = "LORAFLEET_PROMOTE_MARGIN"


class PromotionError(RuntimeError):
    """Promotion or rollback refused; nothing was changed. The message says why and what to do."""


@dataclass
class GateResult:
    ok: bool
    reasons: list[str]
    score: float | None
    champion_score: float | None
    base_score: float | None
    margin: float


def default_margin() -> float:
    """The gate's margin over the base model (absolute nDCG@10), from LORAFLEET_PROMOTE_MARGIN."""
    raw = os.environ.get(MARGIN_ENV)
    if raw is None:
        return DEFAULT_MARGIN
    try:
        return float(raw)
    except ValueError as exc:
        raise PromotionError(f"{MARGIN_ENV}={raw!r} is not a number") from exc


def check_gate(candidate: VersionInfo, champion: VersionInfo | None, margin: float) -> GateResult:
    """Pure: the candidate's test nDCG@10 must reach the champion's and the base's plus `margin`."""
    score = candidate.metric(GATE_METRIC)
    base = candidate.metric(BASE_METRIC)
    champ = champion.metric(GATE_METRIC) if champion is not None else None
    reasons: list[str] = []
    if score is None:
        reasons.append(f"version {candidate.version} has no {GATE_METRIC} tag, so it cannot be judged")
    else:
        if base is None:
            reasons.append(f"version {candidate.version} has no {BASE_METRIC} tag (the base model's score)")
        elif score < base + margin:
            reasons.append(f"{GATE_METRIC} {score:.4f} is {base + margin - score:.4f} below the base model's "
                           f"{base:.4f} + margin {margin:.4f}")
        if champion is not None and champion.version != candidate.version:
            if champ is None:
                reasons.append(f"the champion v{champion.version} has no {GATE_METRIC} tag to compare with")
            elif score < champ:
                reasons.append(f"{GATE_METRIC} {score:.4f} is {champ - score:.4f} below the champion "
                               f"v{champion.version}'s {champ:.4f}")
    return GateResult(not reasons, reasons, score, champ, base, margin)


# -- finding the fleet ----------------------------------------------------------------------------

@dataclass
class FleetTarget:
    nats_url: str
    bases: list[str] | None  # None: learnt from worker heartbeats when connected
    source: str


def find_fleet(nats_url: str | None = None, fleet_file: Path | None = None) -> FleetTarget:
    """The cluster to publish to: --nats-url (and --fleet) if given, else LORAFLEET_HOME/cluster.json."""
    from lorafleet.config import FleetConfig, load_yaml_model

    bases: list[str] | None = None
    if fleet_file is not None:
        bases = [b.name for b in load_yaml_model(FleetConfig, fleet_file).bases]
    if nats_url:
        return FleetTarget(nats_url, bases, "--nats-url")
    from lorafleet.serve.cluster import ClusterError, ClusterState

    try:
        state = ClusterState.load(settings.home())
    except ClusterError as exc:
        raise PromotionError(f"{exc}; or name a running cluster with --nats-url") from exc
    if bases is None:
        with contextlib.suppress(Exception):
            bases = [b.name for b in load_yaml_model(FleetConfig, state.fleet_file).bases]
    return FleetTarget(state.nats_url, bases, str(settings.home() / "cluster.json"))


async def _heartbeat_bases(nc: object, wait_s: float = 2.5) -> list[str]:
    from lorafleet.wire import HEARTBEAT_PREFIX, Heartbeat

    seen: set[str] = set()
    got = asyncio.Event()

    async def on_hb(msg: object) -> None:
        with contextlib.suppress(Exception):
            seen.update(Heartbeat.from_wire(msg.data).bases)  # type: ignore[attr-defined]
            got.set()

    sub = await nc.subscribe(f"{HEARTBEAT_PREFIX}.>", cb=on_hb)  # type: ignore[attr-defined]
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(got.wait(), wait_s)
    await sub.unsubscribe()
    return sorted(seen)


async def _connect(url: str) -> object:
    """A NATS connection that fails fast: nats-py keeps retrying a refused first connect on its own."""
    from urllib.parse import urlsplit

    import nats

    from lorafleet.nats_server import port_open

    parts = urlsplit(url)
    if not port_open(parts.hostname or "127.0.0.1", parts.port or 4222, timeout=2.0):
        raise FleetStateError(f"cannot reach nats-server at {url}: nothing listens there (is the cluster up?)")

    async def _quiet(exc: Exception) -> None:
        return None

    try:
        return await asyncio.wait_for(
            nats.connect(url, connect_timeout=3, allow_reconnect=False, max_reconnect_attempts=0, error_cb=_quiet),
            timeout=6.0)
    except Exception as exc:
        raise FleetStateError(f"cannot reach nats-server at {url}: {type(exc).__name__}: {exc}") from exc


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


def _entry(info: VersionInfo, base: str, profile: ServingProfile | None,
           action: Literal["promote", "rollback"]) -> FleetEntry:
    return FleetEntry(name=info.name, base=base, adapter_id=adapter_id_for(info.name, info.version),
                      adapter_uri=f"models:/{info.name}/{info.version}", profile=profile,
                      version=info.version, registered_model=info.name, action=action)


async def _publish(target: FleetTarget, info: VersionInfo, action: Literal["promote", "rollback"],
                   move_alias: Callable[[], None], undo_alias: Callable[[], None]) -> FleetEntry:
    _, spec = store.bundle_spec(info.name, info.version)
    nc = await _connect(target.nats_url)
    try:
        kv = await open_fleet_bucket(nc.jetstream())  # type: ignore[attr-defined]
        bases = target.bases if target.bases is not None else await _heartbeat_bases(nc)
        if not bases:
            raise PromotionError("cannot tell which base models the fleet serves: no fleet file and no worker "
                                 "heartbeat; pass --fleet FLEET.yaml")
        if spec.base.name not in bases:
            raise PromotionError(f"{info.name} v{info.version} runs on base {spec.base.name!r}, which this fleet "
                                 f"does not serve (it serves: {', '.join(bases)}); add the base to the fleet first")
        entry = _entry(info, spec.base.name, spec.profile, action)
        move_alias()
        try:
            await put_entry(kv, entry)
        except Exception as exc:
            undo_alias()
            raise FleetStateError(f"writing the fleet state failed, alias restored: {exc}") from exc
        return entry
    finally:
        with contextlib.suppress(Exception):
            await nc.close()  # type: ignore[attr-defined]


def promote(name: str, version: str | int | None = None, *, force: bool = False, margin: float | None = None,
            nats_url: str | None = None, fleet_file: Path | None = None) -> Outcome:
    """Gate, move `champion` to the version (default: the `candidate` alias, else the newest), publish live."""
    margin = default_margin() if margin is None else margin
    if version is None:
        version = store.alias_version(name, CANDIDATE)
    info = store.get_version(name, version)
    current = store.alias_version(name, CHAMPION)
    champion = store.get_version(name, current) if current is not None else None
    gate = check_gate(info, champion, margin)
    if not gate.ok and not force:
        raise PromotionError(f"{name} v{info.version} fails the quality gate: " + "; ".join(gate.reasons)
                             + " (use --force to promote anyway)")
    target = find_fleet(nats_url, fleet_file)
    history = store.champion_history(name)

    def move() -> None:
        store.set_alias(name, CHAMPION, info.version)
        if not history or history[-1] != info.version:
            store.set_champion_history(name, [*history, info.version])

    def undo() -> None:
        if current is None:
            store.delete_alias(name, CHAMPION)
        else:
            store.set_alias(name, CHAMPION, current)
        store.set_champion_history(name, history)

    entry = asyncio.run(_publish(target, info, "promote", move, undo))
    return Outcome(name, info.version, current, "promote", entry, gate, target.nats_url)


def rollback(name: str, *, nats_url: str | None = None, fleet_file: Path | None = None) -> Outcome:
    """Move `champion` back to the version that held it before, and publish that live."""
    current = store.alias_version(name, CHAMPION)
    if current is None:
        raise PromotionError(f"{name} has no champion to roll back from (promote a version first)")
    history = store.champion_history(name)
    trimmed = list(history)
    while trimmed and trimmed[-1] == current:
        trimmed.pop()
    if not trimmed:
        raise PromotionError(f"{name}: champion v{current} has no previous champion to roll back to")
    info = store.get_version(name, trimmed[-1])
    target = find_fleet(nats_url, fleet_file)

    def move() -> None:
        store.set_alias(name, CHAMPION, info.version)
        store.set_champion_history(name, trimmed)

    def undo() -> None:
        store.set_alias(name, CHAMPION, current)
        store.set_champion_history(name, history)

    entry = asyncio.run(_publish(target, info, "rollback", move, undo))
    return Outcome(name, info.version, current, "rollback", entry, None, target.nats_url)

