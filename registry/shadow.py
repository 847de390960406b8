"""Shadow promotion (issue 25, part 5): copies of part of a name's requests on a candidate, answers discarded.

`lorafleet promote NAME --shadow P` (generative and rerank bundles; an embedding's vectors cannot be compared across
versions) passes the same gate and preload as a canary, then writes a shadow spec into the name's live fleet entry
(under the promote lock, by compare-and-set). Every gateway mirrors P % of the plain name's requests to the
candidate after the champion has answered, compares the two answers and discards the copy's (serve/shadow.py);
clients only ever see the champion. `--finish` and `--abort` first sum the figures of every gateway (published on
`lorafleet.stats.gateway.<id>.shadow`) and log them to the candidate's MLflow run as an online evaluation
(`online_*` metrics, beside the offline ones), then `--finish` makes the candidate champion through promote's path
and `--abort` removes the shadow. While a shadow runs, a promote, rollback or canary of the name is refused.
Start, abort and dropping a stale shadow share their path with canary.py (registry/transition.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.core.agreement import SHADOW_SUBJECT, GatewayShadowStats, ShadowFigures, ShadowKey, summed
from lorafleet.core.fleet_state import (
    FleetEntry,
    Retention,
    ShadowSpec,
    adapter_id_for,
    canary_spec,
    read_entries,
    read_entry,
)
from lorafleet.core.tasks import GateResult
from lorafleet.nats.client import ClientSettings
from lorafleet.registry import store, transition
from lorafleet.registry.canary import CanaryError
from lorafleet.registry.consistency import Agreement
from lorafleet.registry.fleet_target import FleetTarget, find_fleet, open_fleet, target_retention
from lorafleet.registry.gate import gated_candidate
from lorafleet.registry.lock import locked
from lorafleet.registry.promote import Outcome
from lorafleet.registry.staging import Preload
from lorafleet.registry.store import CANDIDATE, CHAMPION, RegistryError
from lorafleet.registry.transition import Change, Split, finish_split, rewrite, start_split
from lorafleet.registry.writes import run_transition

log = logging.getLogger(__name__)

SHADOW_KINDS = {"causal-lm": "generative", "cross-encoder": "rerank"}  # bundle kinds whose answers compare
LISTEN_S = 2.5  # gateways publish their figures every second: two rounds from each
ONLINE_TAG = "lorafleet.online_evaluation"  # on the candidate's run: what the online_* metrics compare


class ShadowError(CanaryError):
    """A shadow command that does not fit the name's state or kind; nothing changed."""


def check_share(percent: float) -> float:
    """The mirrored share, strictly between 0 and 100."""
    return transition.check_share(percent, "--shadow", "requests copied to the candidate", ShadowError)


def check_kind(name: str, version: str, kind: str | None) -> str:
    """A shadow compares answers: generative text or rerank orders, never embeddings (another vector space)."""
    if kind not in SHADOW_KINDS:
        raise ShadowError(f"{name} v{version} is a {kind or 'sentence-transformers'} bundle: --shadow compares "
                          "answers of generative and rerank models only (vectors of two embedding versions live in "
                          f"different spaces); use `lorafleet promote {name} --canary P` instead")
    return SHADOW_KINDS[kind]


@dataclass(frozen=True)
class ShadowState:
    """One name's champion, shadow and canary, and the shadow's transitions; a refused one raises ShadowError
    (read under the name's promote lock, so the answer holds until the write)."""

    name: str
    champion: str | None
    shadow: str | None = None
    canary: str | None = None

    @classmethod
    def of(cls, name: str, entry: FleetEntry | None) -> ShadowState:
        if entry is None:
            return cls(name, None)
        return cls(name, entry.version, entry.shadow.version if entry.shadow else None,
                   entry.canary.version if entry.canary else None)

    def start(self, version: str) -> ShadowState:
        if self.shadow is not None:
            raise ShadowError(f"a shadow of {self.name} is already in progress (v{self.shadow}); nothing changed. "
                              f"End it first: `lorafleet promote {self.name} --finish` or `--abort`")
        if self.canary is not None:
            raise ShadowError(f"a canary of {self.name} is in progress (v{self.canary}); nothing changed. End it "
                              f"first: `lorafleet promote {self.name} --finish` or `--abort`")
        if self.champion is None:
            raise ShadowError(f"{self.name} is not served yet: a shadow copies a served name's requests; promote a "
                              "first version without --shadow")
        if version == self.champion:
            raise ShadowError(f"v{version} is already the champion of {self.name}; nothing to shadow")
        return dataclasses.replace(self, shadow=version)

    def end(self) -> ShadowState:
        if self.shadow is None:
            raise ShadowError(f"{self.name} has no shadow in progress; nothing changed")
        return dataclasses.replace(self, shadow=None)


@dataclass(frozen=True)
class ShadowOutcome:
    name: str
    champion: str
    shadow: str | None  # None after --abort
    percent: float
    entry: FleetEntry
    gate: GateResult | None
    nats_url: str
    figures: ShadowFigures | None = None  # what the gateways compared (at --finish/--abort)
    logged_to: str | None = None  # the MLflow run the online metrics went to


def start(name: str, version: str | int | None, percent: float, *, force: bool = False, margin: float | None = None,
          nats_url: str | None = None, fleet_file: Path | None = None, creds: Path | None = None,
          preload: Preload | None = None) -> ShadowOutcome:
    """Gate and preload `version` (default: the `candidate` alias, else the newest) like a canary, then mirror
    `percent` % of the name's requests to it. Refused, changing nothing, for a bad share, an embedding bundle, a
    name not served, a shadow or canary already running or another promote holding the name."""
    check_share(percent)  # before anything: a bad flag needs neither the registry nor the cluster
    found = store.get_version(name, store.alias_version(name, CANDIDATE) if version is None else version)
    _, first = store.bundle_spec(found.name, found.version)
    check_kind(name, found.version, first.kind)  # before the gate: a wrong kind fails whatever its scores
    info, margin = gated_candidate(name, found.version, margin, force)
    target = find_fleet(nats_url, fleet_file, creds)

    def allowed(state: Agreement) -> None:
        ShadowState.of(name, state.entry).start(info.version)

    def place(live: FleetEntry, candidate: FleetEntry) -> FleetEntry:
        return live.model_copy(update={"shadow": ShadowSpec(**canary_spec(candidate, percent).model_dump())})

    entry, gate = start_split(target, name, info, Split("shadow", ShadowError, allowed, place), margin=margin,
                              force=force, preload=preload)
    return ShadowOutcome(name, entry.version, info.version, percent, entry, gate, target.nats_url)


# -- the figures ----------------------------------------------------------------------------------------------

def shadow_key(entry: FleetEntry) -> ShadowKey:
    assert entry.shadow is not None
    return entry.name, entry.version, entry.shadow.version, entry.shadow.started


async def collect(nc: Any, listen_s: float = LISTEN_S) -> dict[str, GatewayShadowStats]:
    """The latest shadow figures of every gateway heard within `listen_s`, keyed by gateway id."""
    latest: dict[str, GatewayShadowStats] = {}

    async def handler(msg: Any) -> None:
        try:
            stats = GatewayShadowStats.from_wire(msg.data)
        except Exception:
            log.debug("ignoring malformed shadow figures on %s", msg.subject)
            return
        if stats.gateway not in latest or latest[stats.gateway].ts <= stats.ts:
            latest[stats.gateway] = stats

    sub = await nc.subscribe(SHADOW_SUBJECT, cb=handler)
    try:
        await asyncio.sleep(listen_s)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return latest


def log_online(name: str, version: str, champion: str, percent: float, figures: ShadowFigures) -> str | None:
    """The figures as `online_*` metrics (and what they compare, as tags) on the candidate version's MLflow run;
    the run id, or None when the version has no run. Best effort: ending the shadow is what counts."""
    from mlflow.entities import Metric, RunTag

    try:
        c = store.client()
        run_id = c.get_model_version(name, version).run_id
        if not run_id:
            return None
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, 0) for k, v in sorted(figures.online_metrics().items())]
        tags = [RunTag(ONLINE_TAG, f"shadow of {percent:g} % against champion v{champion}"),
                RunTag("lorafleet.online_champion", str(champion))]
        c.log_batch(run_id, metrics=metrics, tags=tags)
        return str(run_id)
    except Exception as exc:
        log.warning("could not log the shadow figures of %s v%s to MLflow: %s", name, version, exc)
        return None


async def _figures(nc: Any, entry: FleetEntry, listen_s: float) -> ShadowFigures:
    return summed(await collect(nc, listen_s), shadow_key(entry))


# -- ending it ------------------------------------------------------------------------------------------------

def running(name: str, *, nats_url: str | None = None, fleet_file: Path | None = None,
            creds: Path | None = None) -> FleetEntry | None:
    """The live entry of `name` (None: not served), for the CLI's --finish/--abort to choose shadow or canary."""
    target = find_fleet(nats_url, fleet_file, creds)

    async def run() -> FleetEntry | None:
        async with open_fleet(target.nats_url, target.client) as (_, kv):
            entry, _ = await read_entry(kv, name)
            return entry

    return asyncio.run(run())


async def _gather_and_log(target: FleetTarget, name: str, listen_s: float
                          ) -> tuple[FleetEntry, ShadowFigures, str | None]:
    async with open_fleet(target.nats_url, target.client) as (nc, kv):
        entry, _ = await read_entry(kv, name)
        ShadowState.of(name, entry).end()
        assert entry is not None and entry.shadow is not None
        figures = await _figures(nc, entry, listen_s)
    run_id = await asyncio.to_thread(log_online, name, entry.shadow.version, entry.version, entry.shadow.percent,
                                     figures)
    return entry, figures, run_id


def abort(name: str, *, nats_url: str | None = None, fleet_file: Path | None = None, creds: Path | None = None,
          listen_s: float = LISTEN_S) -> ShadowOutcome:
    """Log what the gateways compared to the candidate's run, then remove the shadow (the champion unchanged)."""
    target = find_fleet(nats_url, fleet_file, creds)

    async def run() -> ShadowOutcome:
        seen, figures, run_id = await _gather_and_log(target, name, listen_s)
        assert seen.shadow is not None

        def change(entry: FleetEntry | None) -> Change:
            ShadowState.of(name, entry).end()
            assert entry is not None and entry.shadow is not None and seen.shadow is not None
            if entry.shadow.version != seen.shadow.version:
                raise ShadowError(f"{name}: the shadow changed while its figures were read; nothing changed")
            return Change(entry.model_copy(update={"shadow": None}), ends=entry.shadow.version)

        async with open_fleet(target.nats_url, target.client) as (_, kv), \
                locked(kv, name, "shadow abort", ShadowError) as lock:
            done = await rewrite(kv, lock, name, change)
        assert done is not None
        return ShadowOutcome(name, done.entry.version, None, seen.shadow.percent, done.entry, None, target.nats_url,
                             figures, run_id)

    return run_transition(run())


def finish(name: str, *, force: bool = False, margin: float | None = None, nats_url: str | None = None,
           fleet_file: Path | None = None, creds: Path | None = None, preload: Preload | None = None,
           retention: Retention | None = None, retention_changes: dict[str, float | int | None] | None = None,
           listen_s: float = LISTEN_S) -> tuple[Outcome, ShadowFigures, str | None]:
    """Log the figures, then the candidate becomes champion through promote's path (gate against the champion as
    it is then, preload, compare-and-set, the old champion retained as NAME@N); the entry it writes has no shadow."""
    target = target_retention(find_fleet(nats_url, fleet_file, creds), retention, retention_changes)
    seen, figures, run_id = asyncio.run(_gather_and_log(target, name, listen_s))
    assert seen.shadow is not None
    version = seen.shadow.version

    def pick(state: Agreement) -> str:
        now = ShadowState.of(name, state.entry)
        now.end()
        if now.shadow != version:
            raise ShadowError(f"{name}: the shadow in progress is v{now.shadow}, not v{version}; nothing changed")
        return version

    out = finish_split(target, name, pick, lambda state: version, margin=margin, force=force, preload=preload)
    return out, figures, run_id


# -- status, consistency ----------------------------------------------------------------------------------------

def describe(entry: FleetEntry) -> dict[str, Any]:
    """A name's shadow as `lorafleet status` shows it."""
    s = entry.shadow
    assert s is not None
    return {"name": entry.name, "champion": entry.version, "shadow": s.version, "percent": s.percent,
            "started": s.started}


async def read_shadows(nats_url: str, client: ClientSettings | None = None, listen_s: float = LISTEN_S
                       ) -> list[dict[str, Any]]:
    """Every shadow in the fleet state with the figures the gateways have so far (for `lorafleet status`)."""
    async with open_fleet(nats_url, client) as (nc, kv):
        entries = [e for _, e in sorted((await read_entries(kv)).items()) if e.shadow is not None]
        latest = await collect(nc, listen_s) if entries else {}
        return [{**describe(e), "figures": summed(latest, shadow_key(e)).online_metrics()} for e in entries]


def split_problem(entry: FleetEntry, registered: set[str], champion: str | None) -> str | None:
    """Why the canary or shadow of `entry` is no longer consistent (None: it is): its version is gone from the
    registry, it is the champion (alias or served), or its adapter is not that version's."""
    for what, spec in (("canary", entry.canary), ("shadow", entry.shadow)):
        if spec is None:
            continue
        v = spec.version
        if v not in registered:
            return f"the {what}'s v{v} is no longer in the registry"
        if v in (champion, entry.version):
            return f"the {what}'s v{v} is the champion now"
        if spec.adapter_id != adapter_id_for(entry.name, v):
            return f"the {what}'s adapter {spec.adapter_id} is not v{v}'s"
    return None


def drop_stale(name: str, *, repair: bool, nats_url: str | None = None, fleet_file: Path | None = None,
               creds: Path | None = None) -> str | None:
    """`registry check`: the reason the name's canary or shadow is inconsistent (None: none, or it is fine); with
    `repair`, drop it (under the promote lock, by compare-and-set): all traffic on the champion, nothing mirrored."""
    target = find_fleet(nats_url, fleet_file, creds)

    def problem(entry: FleetEntry | None) -> str | None:
        if entry is None or (entry.canary is None and entry.shadow is None):
            return None
        try:
            registered = {v.version for v in store.versions(name)}
        except RegistryError:
            registered = set()
        return split_problem(entry, registered, store.alias_version(name, CHAMPION))

    def change(entry: FleetEntry | None) -> Change | None:
        why = problem(entry)
        if why is None or entry is None:
            return None
        return Change(entry.model_copy(update={"canary": None, "shadow": None}), why=why)

    async def run() -> str | None:
        async with open_fleet(target.nats_url, target.client) as (_, kv):
            entry, _ = await read_entry(kv, name)
            why = await asyncio.to_thread(problem, entry)
            if why is None or not repair:
                return why
            async with locked(kv, name, "repair", ShadowError) as lock:
                done = await rewrite(kv, lock, name, change)
            return done.why if done is not None else None

    return run_transition(run())


__all__ = ["ShadowError", "ShadowOutcome", "ShadowState", "abort", "check_kind", "check_share", "collect",
           "drop_stale", "finish", "log_online", "read_shadows", "running", "split_problem", "start"]
