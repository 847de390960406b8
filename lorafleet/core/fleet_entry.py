"""What the fleet should serve under one name: the entry (`FleetEntry`), the versions it carries besides its
champion (retained, canary, shadow), and the pure rules on them (retention, canary split, routes). No NATS:
fleet_state.py keeps these entries in a KV bucket and watches them; its module re-exports these names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from lorafleet.core.config import ServedModel, ServingProfile, StrictModel

log = logging.getLogger(__name__)

KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

# A promotion's lock (`lorafleet promote`/`rollback`): held in the fleet bucket from before the champion is read
# until the fleet state is written, so two promotions of one name never interleave (registry/promote.py).
LOCK_PREFIX = "_lock."
# A promotion's staged entry (`lorafleet promote`): the new version under `_preload.NAME` while the workers of
# its base preload it, before the live entry NAME is written. Not a served name either, so gateways never
# route by it; workers turn it into a preload.
PRELOAD_PREFIX = "_preload."


class FleetStateError(RuntimeError):
    """The fleet state cannot be read or written (NATS unreachable, bucket missing, bad entry)."""


DEFAULT_RETAIN_S = 7 * 24 * 3600.0
DEFAULT_RETAIN_VERSIONS = 2
RETIRED_KEPT = 64  # retired version numbers remembered per name (for 410 rather than 404); the oldest go first


class ServedVersion(StrictModel):
    """One version of a served name as a gateway routes it and a worker loads it: what a retained version, a
    canary and a shadow hold, and what they copy from (and back into) a live entry (`served_fields`)."""

    version: str
    base: str
    adapter_id: str
    adapter_uri: str
    profile: ServingProfile | None = None
    kind: str | None = None
    system_prompt: str | None = None
    chat_template: str | None = None
    generation: dict[str, Any] | None = None


def served_fields(src: ServedVersion | FleetEntry) -> dict[str, Any]:
    """The ServedVersion fields of a version or a live entry (both have them under the same names)."""
    return {k: getattr(src, k) for k in ServedVersion.model_fields}


class RetainedVersion(ServedVersion):
    """A former champion still served under its pinned name NAME@N after a promote (issue 25): a client's index
    built with it keeps working until it has re-embedded with the new version."""

    superseded: float = Field(description="When it stopped being the champion (epoch seconds).")
    until: float | None = Field(None, description="Retired after this (epoch seconds); None: no time limit.")


class CanarySpec(ServedVersion):
    """A canary of a promoted name (issue 25): `percent` of the plain name's traffic, by a sticky hash of each
    client's route key, goes to this version; the rest stays on the champion. In the fleet state so every gateway
    applies the same split and a restart keeps it. Written by `promote --canary`, removed by `--finish`/`--abort`."""

    percent: float = Field(gt=0, lt=100)
    started: float = Field(default_factory=time.time)
    # `--watch`: who compares the two sides and until when (None: nobody watches; the canary stays as it is).
    watcher: str | None = None
    watch_until: float | None = None


class ShadowSpec(CanarySpec):
    """A shadow of a promoted name (issue 25, part 5): `percent` of the plain name's requests are also sent to this
    version; clients only ever get the champion's answer, the copy's is compared with it and discarded. Generative
    and rerank names only. Written by `promote --shadow`, removed by `--finish`/`--abort` (registry/shadow.py)."""


class FleetEntry(StrictModel):
    """What the fleet should serve under one name."""

    name: str = Field(pattern=KEY_RE.pattern)
    base: str
    adapter_id: str = Field(description="Workers' cache key, NAME@vN: a new version is a new adapter.")
    adapter_uri: str = Field(description="models:/NAME/N (fetched from MLflow and verified) or a local folder.")
    profile: ServingProfile | None = None
    version: str
    registered_model: str
    action: Literal["promote", "rollback", "set"] = "set"
    updated: float = Field(default_factory=time.time)
    # Optional (issue 14), from a generative bundle's details: what the gateway applies to this name.
    kind: str | None = Field(None, description="The bundle kind: sentence-transformers, causal-lm, …")
    system_prompt: str | None = Field(None, description="Applied when a chat request brings no system message.")
    chat_template: str | None = Field(None, description="Replaces the base's chat template for this name.")
    generation: dict[str, Any] | None = Field(None, description="Defaults for parameters a request leaves out "
                                              "(max_tokens, temperature, top_p): what the bundle was scored with.")
    # Issue 25: former champions still served as NAME@N (most recently superseded first), and versions once served
    # here and no longer (a pinned request for one is answered 410, not 404). Written by promote/rollback only.
    retained: list[RetainedVersion] = Field(default_factory=list)
    retired: list[str] = Field(default_factory=list)
    canary: CanarySpec | None = None  # a version taking part of the plain name's traffic (promote --canary)
    shadow: ShadowSpec | None = None  # a version getting copies of part of the traffic (promote --shadow)

    def to_bytes(self) -> bytes:
        # Without retention/canary/shadow keys when empty: such an entry stays readable by older processes.
        empty = {k for k in ("retained", "retired", "canary", "shadow") if not getattr(self, k)}
        return self.model_dump_json(exclude=empty or None).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> FleetEntry:
        return cls.model_validate(json.loads(data))

    def served_model(self) -> ServedModel:
        return ServedModel(name=self.name, base=self.base, adapter=self.adapter_uri, adapter_id=self.adapter_id,
                           profile=self.profile)

    def retained_as_entry(self, kept: RetainedVersion) -> FleetEntry:
        """A retained version as the live entry it once was (what a gateway routes NAME@N by)."""
        return self.model_copy(update={**served_fields(kept), "retained": [], "retired": []})

    def canary_as_entry(self, c: CanarySpec | None = None) -> FleetEntry | None:
        """The canary (or the spec `c`: the shadow) as the live entry it would be (what a gateway routes by)."""
        c = self.canary if c is None else c
        if c is None:
            return None
        return self.model_copy(update={**served_fields(c), "retained": [], "retired": [], "canary": None,
                                       "shadow": None})

    def shadow_as_entry(self) -> FleetEntry | None:
        return self.canary_as_entry(self.shadow) if self.shadow is not None else None


def canary_spec(candidate: FleetEntry, percent: float, now: float | None = None) -> CanarySpec:
    """The canary that sends `percent` of the name's traffic to `candidate` (an entry as promote would write it)."""
    return CanarySpec(**served_fields(candidate), percent=percent, started=time.time() if now is None else now)


def route_bucket(name: str, key: str) -> float:
    """Where a client's route key falls in [0, 100) for `name`: sha256 of both (never Python's hash(), salted per
    process), so every gateway, before and after a restart, puts one key on the same side. A canary of P % takes
    the keys below P, so raising P only adds keys: none switches back."""
    digest = hashlib.sha256(f"{name}\n{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") * 100.0 / 2.0**64


def takes_canary(entry: FleetEntry, key: str | None) -> bool:
    """Whether a request of `entry.name` with this route key goes to the canary (a request without a key: never)."""
    return entry.canary is not None and key is not None and route_bucket(entry.name, key) < entry.canary.percent


class CanaryInProgress(FleetStateError):
    """A promote or rollback of a name under a canary: the canary must finish or be aborted first."""


def refuse_during_canary(entry: FleetEntry | None) -> None:
    """CanaryInProgress when `entry` is under a canary (promote and rollback check it under the name's lock)."""
    if (why := canary_in_progress(entry)) is not None:
        raise CanaryInProgress(why)


def canary_in_progress(entry: FleetEntry | None) -> str | None:
    """Why a promote or rollback of `entry.name` must wait (a canary holds the name), or None."""
    if entry is not None and entry.shadow is not None:
        sh = entry.shadow
        return (f"a shadow of {entry.name} is in progress (v{sh.version} gets copies of {sh.percent:g} % of its "
                f"requests, champion v{entry.version}); nothing changed. End it first: `lorafleet promote "
                f"{entry.name} --finish` or `--abort`")
    if entry is None or entry.canary is None:
        return None
    c = entry.canary
    return (f"a canary of {entry.name} is in progress (v{c.version} takes {c.percent:g} % of its traffic, champion "
            f"v{entry.version}); nothing changed. End it first: `lorafleet promote {entry.name} --finish` or "
            "`--abort`")


def adapter_id_for(name: str, version: str | int) -> str:
    return f"{name}@v{version}"


@dataclass(frozen=True)
class Retention:
    """How long a former champion stays served as NAME@N after a promote or rollback: at most `seconds` after it
    was superseded and only while it is among the `versions` most recently superseded (None: no such limit; 0
    versions or 0 seconds: the old version is retired at once)."""

    seconds: float | None = DEFAULT_RETAIN_S
    versions: int | None = DEFAULT_RETAIN_VERSIONS

    def describe(self) -> str:
        when = "no time limit" if self.seconds is None else f"{self.seconds / 86400:g} days" \
            if self.seconds >= 86400 else f"{self.seconds:g}s"
        count = "any number of" if self.versions is None else str(self.versions)
        return f"{when}, {count} former version(s)"


def retained_live(entry: FleetEntry, now: float) -> list[RetainedVersion]:
    """The retained versions of `entry` whose time has not run out at `now` (the gateway checks per request:
    nobody writes the fleet state when a window ends)."""
    return [r for r in entry.retained if r.until is None or r.until > now]


def with_retention(old: FleetEntry | None, new: FleetEntry, retention: Retention, now: float) -> FleetEntry:
    """The entry to write when `new` replaces `old` as the live entry: the previous champion joins the retained
    versions (for the retention window), those past their time or beyond the count move to `retired`, and the new
    version leaves both lists (it is live again). Pure: promote calls it under the name's lock, on the entry it
    compare-and-sets against."""
    kept = list(old.retained) if old is not None else []
    retired = list(old.retired) if old is not None else []
    if old is not None and old.version != new.version:
        until = None if retention.seconds is None else now + retention.seconds
        kept.insert(0, RetainedVersion(**served_fields(old), superseded=now, until=until))
    seen: set[str] = {new.version}
    unique = []
    for r in kept:  # most recently superseded first: an older record of the same version goes
        if r.version not in seen:
            seen.add(r.version)
            unique.append(r)
    live = [r for r in unique if r.until is None or r.until > now]
    if retention.versions is not None:
        live = live[: retention.versions]
    gone = [r.version for r in unique if r not in live]
    retired = [v for v in dict.fromkeys([*gone, *retired]) if v != new.version][:RETIRED_KEPT]
    return new.model_copy(update={"retained": live, "retired": retired})


def is_served_key(key: str) -> bool:
    """A key that holds a served name's live entry (not the fleet file, not a staged preload)."""
    return KEY_RE.match(key) is not None


def preload_key(name: str) -> str:
    return f"{PRELOAD_PREFIX}{name}"


def served_models(entries: Iterable[FleetEntry], bases: Iterable[str]) -> list[ServedModel]:
    """ServedModels for the entries whose base this fleet serves; the others are logged and skipped."""
    known = set(bases)
    out = []
    for e in sorted(entries, key=lambda e: e.name):
        if e.base not in known:
            log.warning("fleet state names %s on base %s, which this fleet does not serve; ignored", e.name, e.base)
            continue
        if e.name in known:
            log.warning("fleet state entry %s shadows a base model name; ignored", e.name)
            continue
        out.append(e.served_model())
    return out


def merge_models(static: Iterable[ServedModel], entries: Iterable[FleetEntry], bases: Iterable[str]
                 ) -> list[ServedModel]:
    """The fleet file's served models plus the promoted ones; a promoted name replaces a static one."""
    bases = list(bases)
    promoted = served_models(entries, bases)
    names = {m.name for m in promoted}
    return [m for m in static if m.name not in names] + promoted


def by_adapter_id(entries: Iterable[FleetEntry]) -> dict[str, ServedModel]:
    """What a worker needs per adapter id: URI and serving profile of every promoted version, the retained former
    champions included (their pinned requests load them on demand like any adapter)."""
    out = {}
    for e in entries:
        for kept in e.retained:
            out[kept.adapter_id] = ServedModel(name=f"{e.name}@{kept.version}", base=kept.base,
                                               adapter=kept.adapter_uri, adapter_id=kept.adapter_id,
                                               profile=kept.profile)
        for canary in (e.canary_as_entry(), e.shadow_as_entry()):
            if canary is not None:
                out[canary.adapter_id] = canary.served_model().model_copy(
                    update={"name": f"{e.name}@{canary.version}"})
        out[e.adapter_id] = e.served_model()
    return out
