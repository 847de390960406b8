"""Automatic rollback of a canary (issue 25): `lorafleet promote NAME --canary P --watch DURATION`.

Every gateway publishes, with its presence, cumulative per-version counters (requests, 5xx errors, a latency
histogram on fixed buckets: lorafleet.core.heartbeats.GatewayStats). The watcher sums each gateway's deltas since the
watch began, so it judges the whole fleet's traffic, and compares the candidate with the champion by a pure
function (`judge`): an error rate higher by more than `max_error_increase` (absolute), a p99 above the
champion's × `max_p99_ratio`, or (generative) a rate of empty answers higher by more than `max_empty_increase`,
once the candidate has `min_requests`, aborts the canary at once with the reason;
a window that ends without a failure finishes it (the candidate becomes champion through promote's path). Too
little traffic on either side to judge leaves the canary as it is and says so.

The watcher writes `watcher` (host/pid) and `watch_until` into the canary's spec by compare-and-set under the
promote lock, and says it is alive as presence `control/watch-<name>`: when the watching command dies, the
canary stays at its percentage (safe) and `lorafleet status` says that nobody watches it.

A failing canary is aborted within `abort_within_s` (issue 38), whatever else holds the name's lock for a moment
(a CI promote that takes it and is refused, a repair): the abort waits for the lock's release on its KV watch and
tries again, with a short backoff against one that takes it again at once; the mark is cleared the same way. The
watch's connection pings and reconnects like a gateway's (`fleet_target.connect(lasting=True)`): a server that goes
silent is noticed within seconds, and the watch goes on through another node of a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from lorafleet.core import heartbeats
from lorafleet.core.fleet_state import FleetEntry, Retention, open_fleet_bucket, read_entry
from lorafleet.core.heartbeats import GatewayStats, VersionCounts
from lorafleet.registry import canary, store
from lorafleet.registry.fleet_target import connect, find_fleet
from lorafleet.registry.lock import LOCK_TTL_S, LockBusy, promote_lock, wait_released
from lorafleet.registry.promote import Outcome
from lorafleet.registry.staging import Preload
from lorafleet.registry.transition import Change, rewrite

log = logging.getLogger(__name__)

SAMPLE_EVERY_S = 2.0  # gateways publish every PRESENCE_EVERY_S; a few samples per decision is plenty
# A holder that died leaves the lock for at most its TTL; one that lives releases it soon (a refused promote, a
# repair). A failing canary is aborted within this, or the watch says loudly that it could not.
ABORT_WITHIN_S = 2 * LOCK_TTL_S
UNMARK_WITHIN_S = 10.0  # clearing the watcher at the end (an interrupted watch should not hang on it)
BACKOFF_S = (0.05, 1.0)  # first and longest pause before a retry that follows a release at once

T = TypeVar("T")
ABORT_TAG = "lorafleet.canary_aborted"  # on the candidate's model version (and its run): why the watch aborted it


@dataclass(frozen=True)
class Margins:
    """How much worse the candidate may be than the champion before the watch aborts it."""

    max_error_increase: float = 0.01  # absolute: 0.01 = one percentage point above the champion's error rate
    max_p99_ratio: float = 1.5  # candidate p99 may be up to 1.5 × the champion's
    min_requests: int = 20  # per side, before a comparison counts
    # absolute: generative answers with no text (stopped or cut at max_tokens before any) per successful answer
    max_empty_increase: float = 0.05

    def __post_init__(self) -> None:
        if not 0 <= self.max_error_increase < 1:
            raise canary.CanaryError(f"--max-error-increase {self.max_error_increase}: must be at least 0 and "
                                     "below 1 (a fraction: 0.01 is one percentage point)")
        if self.max_p99_ratio < 1:
            raise canary.CanaryError(f"--max-p99-ratio {self.max_p99_ratio}: must be 1 or more")
        if self.min_requests < 1:
            raise canary.CanaryError(f"--min-requests {self.min_requests}: must be 1 or more")
        if not 0 <= self.max_empty_increase < 1:
            raise canary.CanaryError(f"--max-empty-increase {self.max_empty_increase}: must be at least 0 and below "
                                     "1 (a fraction: 0.05 is five percentage points)")


@dataclass(frozen=True)
class Verdict:
    """`fail`: abort now; `pass`: nothing wrong so far (enough data on both sides); `wait`: too little data."""

    decision: Literal["fail", "pass", "wait"]
    reason: str


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _secs(x: float) -> str:
    return "above 60 s" if x == float("inf") else f"{x * 1000:g} ms"


def judge(champion: VersionCounts, candidate: VersionCounts, margins: Margins) -> Verdict:
    """Compare the two sides' figures over the same window (summed over all gateways)."""
    if candidate.requests < margins.min_requests:
        return Verdict("wait", f"the candidate answered {candidate.requests} requests (fewer than "
                               f"{margins.min_requests} to judge)")
    # An error rate far above the margin is a failure even before the champion has its own minimum: a candidate
    # that fails every request must not wait for the champion's traffic.
    champion_rate = champion.error_rate if champion.requests else 0.0
    if candidate.error_rate > champion_rate + margins.max_error_increase:
        return Verdict("fail", f"error rate {_pct(candidate.error_rate)} ({candidate.errors} of "
                               f"{candidate.requests}) against the champion's {_pct(champion_rate)} ({champion.errors} "
                               f"of {champion.requests}); allowed: {_pct(margins.max_error_increase)} more")
    if champion.requests < margins.min_requests:
        return Verdict("wait", f"the champion answered {champion.requests} requests (fewer than "
                               f"{margins.min_requests} to compare latency)")
    p99c, p99k = candidate.quantile(0.99), champion.quantile(0.99)
    if p99c > p99k * margins.max_p99_ratio:
        return Verdict("fail", f"p99 {_secs(p99c)} against the champion's {_secs(p99k)}; allowed: "
                               f"{margins.max_p99_ratio:g} ×")
    # Generative answers with no text: a template that breaks on real prompts answers 200 with nothing in it.
    if candidate.empty_rate > champion.empty_rate + margins.max_empty_increase:
        return Verdict("fail", f"empty answers {_pct(candidate.empty_rate)} ({candidate.empty} of "
                               f"{candidate.requests - candidate.errors}) against the champion's "
                               f"{_pct(champion.empty_rate)} ({champion.empty} of "
                               f"{champion.requests - champion.errors}); allowed: "
                               f"{_pct(margins.max_empty_increase)} more")
    empty = (f", empty answers {_pct(candidate.empty_rate)} vs {_pct(champion.empty_rate)}"
             if candidate.empty or champion.empty else "")
    return Verdict("pass", f"error rate {_pct(candidate.error_rate)} vs {_pct(champion.error_rate)}, p99 "
                           f"{_secs(p99c)} vs {_secs(p99k)}{empty} over {candidate.requests} + {champion.requests} "
                           "requests")


@dataclass
class Tally:
    """Per-version deltas since the watch began, summed over gateways. A gateway's first message is its baseline
    (what it counted before the watch is not the watch's); a counter that goes down means the gateway restarted,
    so what it had counted since the baseline is kept and its new counters count from 0."""

    baseline: dict[str, dict[tuple[str, str], VersionCounts]] = field(default_factory=dict)
    latest: dict[str, dict[tuple[str, str], VersionCounts]] = field(default_factory=dict)
    banked: dict[tuple[str, str], VersionCounts] = field(default_factory=dict)

    def add(self, stats: GatewayStats) -> None:
        gw = stats.gateway
        if gw not in self.baseline:
            self.baseline[gw], self.latest[gw] = dict(stats.versions), dict(stats.versions)
            return
        before, last = self.baseline[gw], self.latest[gw]
        if any(c.lower_than(last.get(k, VersionCounts())) for k, c in stats.versions.items()) or \
                any(k not in stats.versions for k in last):
            for k, c in last.items():  # restarted: bank what it counted, count again from zero
                self.banked[k] = self.banked.get(k, VersionCounts()) + (c - before.get(k, VersionCounts()))
            self.baseline[gw] = {}
        self.latest[gw] = dict(stats.versions)

    def total(self, name: str, version: str) -> VersionCounts:
        key = (name, version)
        out = self.banked.get(key, VersionCounts())
        for gw, last in self.latest.items():
            if key in last:
                out = out + (last[key] - self.baseline[gw].get(key, VersionCounts()))
        return out


@dataclass(frozen=True)
class WatchOutcome:
    name: str
    result: Literal["aborted", "finished", "undecided", "ended"]  # ended: someone else ended the canary
    reason: str
    champion: VersionCounts
    candidate: VersionCounts
    finished: Outcome | None = None


def watcher_id() -> str:
    return f"{socket.gethostname()}/{os.getpid()}"


def presence_name(name: str) -> str:
    return f"watch-{name}"


def _tag_abort(name: str, version: str, reason: str) -> None:
    """The reason, on the candidate's model version and its MLflow run (best effort: the abort is what counts)."""
    try:
        c = store.client()
        c.set_model_version_tag(name, version, ABORT_TAG, reason[:5000])
        mv = c.get_model_version(name, version)
        if mv.run_id:
            c.set_tag(mv.run_id, ABORT_TAG, reason[:5000])
    except Exception as exc:
        log.warning("could not tag %s v%s with the abort reason: %s", name, version, exc)


async def while_busy(kv: Any, name: str, attempt: Callable[[], Awaitable[T]], within_s: float,
                     say: Callable[[str], None] = log.info) -> T:
    """`attempt()` until it does not meet LockBusy: after each refusal, wait for the lock's release (its KV watch),
    then a short backoff that grows (against a holder that takes it again at once); CanaryError once `within_s`
    has passed."""
    deadline = time.monotonic() + within_s
    pause = BACKOFF_S[0]
    while True:
        try:
            return await attempt()
        except LockBusy as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise canary.CanaryError(f"{exc} (waited {within_s:g}s for it)") from exc
            who = exc.holder.describe() if exc.holder is not None else "another command"
            say(f"{name}: the name's lock is held ({who}); waiting for its release (up to {left:.0f}s more)")
            if await wait_released(kv, name, left):
                await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(BACKOFF_S[1], pause * 2)


async def _mark(kv: Any, name: str, version: str, watcher: str | None, until: float | None) -> FleetEntry:
    """Write (or clear) the watcher of the canary of `version`, by compare-and-set under the promote lock;
    LockBusy when another holds the name (`while_busy` tries again)."""
    def change(entry: FleetEntry | None) -> Change:
        if entry is None or entry.canary is None or entry.canary.version != version:
            raise canary.CanaryError(f"{name} has no canary of v{version} in progress (any more); nothing to watch")
        spec = entry.canary.model_copy(update={"watcher": watcher, "watch_until": until})
        return Change(entry.model_copy(update={"canary": spec}))

    async with promote_lock(kv, name, "canary watch") as lock:
        done = await rewrite(kv, lock, name, change)
    assert done is not None
    return done.entry


def watch(name: str, duration_s: float, margins: Margins | None = None, *, nats_url: str | None = None,
          fleet_file: Path | None = None, creds: Path | None = None, every_s: float = SAMPLE_EVERY_S,
          force: bool = False, margin: float | None = None, preload: Preload | None = None,
          retention: Retention | None = None, retention_changes: dict[str, float | int | None] | None = None,
          say: Callable[[str], None] = print, abort_within_s: float = ABORT_WITHIN_S) -> WatchOutcome:
    """Watch the canary of `name` in progress for `duration_s`: abort it as soon as the candidate is worse by the
    margins (within `abort_within_s`, whoever holds the lock meanwhile), finish it when the window passes
    (finish's gate and preload as `promote --finish`)."""
    if duration_s <= 0:
        raise canary.CanaryError(f"--watch: the window must be longer than 0 s (got {duration_s:g})")
    margins = margins or Margins()
    target = find_fleet(nats_url, fleet_file, creds)

    async def run() -> WatchOutcome:
        nc = await connect(target.nats_url, target.client, lasting=True)
        tally = Tally()
        sub = beacon = None
        version = ""
        marked = False
        try:
            kv = await open_fleet_bucket(nc.jetstream())  # type: ignore[attr-defined]
            entry, _ = await read_entry(kv, name)
            state = canary.CanaryState.of(name, entry)
            if state.canary is None or state.champion is None:
                raise canary.CanaryError(f"{name} has no canary in progress to watch (start one with "
                                         f"`lorafleet promote {name} --canary P --watch DURATION`)")
            version, champion = state.canary, state.champion
            sub = await heartbeats.subscribe_stats(nc, tally.add)  # before the mark: the baseline is heard first
            beacon = heartbeats.Beacon(nc, "control", presence_name(name), lambda: "watching")
            beacon.start()
            until = time.time() + duration_s
            await while_busy(kv, name, lambda: _mark(kv, name, version, watcher_id(), until), abort_within_s, say)
            marked = True
            say(f"{name}: watching canary v{version} against champion v{champion} until "
                f"{time.strftime('%H:%M:%S', time.localtime(until))} (abort if its error rate is "
                f"{_pct(margins.max_error_increase)} higher or its p99 above {margins.max_p99_ratio:g} × the "
                f"champion's)")
            verdict = Verdict("wait", "no figures from any gateway yet")
            while True:
                now = time.time()
                await asyncio.sleep(max(0.0, min(every_s, until - now)))
                try:
                    current, _ = await read_entry(kv, name)
                except Exception as exc:  # a reconnect in progress: the stats go on, read again next round
                    log.warning("watch %s: reading the fleet state failed (%s); trying again", name, exc)
                    continue
                if current is None or current.canary is None or current.canary.version != version:
                    marked = False
                    return WatchOutcome(name, "ended", "the canary was ended while it was watched",
                                        tally.total(name, champion), tally.total(name, version))
                cand, champ = tally.total(name, version), tally.total(name, champion)
                verdict = judge(champ, cand, margins)
                log.info("watch %s v%s: %s (%s)", name, version, verdict.decision, verdict.reason)
                if verdict.decision == "fail":
                    reason = f"v{version} is worse than champion v{champion}: {verdict.reason}"
                    say(f"{name}: {reason}: aborting")
                    await while_busy(kv, name, lambda: canary.abort_on(kv, name, expect=version), abort_within_s,
                                     say)
                    marked = False
                    await asyncio.to_thread(_tag_abort, name, version, reason)
                    return WatchOutcome(name, "aborted", reason, champ, cand)
                if time.time() >= until:
                    break
            if verdict.decision != "pass":
                return WatchOutcome(name, "undecided", f"too little traffic to judge: {verdict.reason}; the "
                                    f"canary stays at {state.percent:g} %", champ, cand)
            done = await asyncio.to_thread(
                canary.finish, name, force=force, margin=margin, nats_url=target.nats_url, fleet_file=fleet_file,
                creds=creds, preload=preload, retention=retention, retention_changes=retention_changes,
                expect=version)
            marked = False
            return WatchOutcome(name, "finished", verdict.reason, champ, cand, done)
        finally:
            if marked:  # undecided or interrupted: the canary stays, and says that nobody watches it any more
                with contextlib.suppress(Exception):
                    await while_busy(kv, name, lambda: _mark(kv, name, version, None, None), UNMARK_WITHIN_S, say)
            if beacon is not None:
                await beacon.stop()
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await nc.close()  # type: ignore[attr-defined]

    return asyncio.run(run())


__all__ = ["ABORT_TAG", "ABORT_WITHIN_S", "Margins", "Tally", "Verdict", "WatchOutcome", "judge", "presence_name",
           "watch", "watcher_id", "while_busy"]
