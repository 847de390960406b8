"""The desired fleet state: one NATS KV entry per promoted served name, watched by gateways and workers.

Key = the served name (e.g. `german-legal`); value = JSON of `FleetEntry` (JSON, not MessagePack,
so `nats kv get lorafleet_fleet german-legal` is readable by a person). Gateways turn the table into
routes (served name → base + adapter id + adapter URI); workers take each entry's serving profile
and fetch the adapter from its URI on first use. The adapter id carries the version
(`german-legal@v3`), so tasks already queued for the old version still name the old adapter and
finish on it while new requests use the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from lorafleet.core.config import (
    ConfigError,
    FleetConfig,
    ServedModel,
    ServingProfile,
    StrictModel,
    validate_model,
)
from lorafleet.core.urls import server_urls
from lorafleet.core.wire import FLEET_CONFIG_KV_BUCKET, FLEET_KV_BUCKET

log = logging.getLogger(__name__)

KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# The fleet file itself, for processes on other hosts (`lorafleet worker`/`gateway` without --fleet): the key in
# its own bucket (FLEET_CONFIG_KV_BUCKET), which only the admin role may write. Not in the fleet bucket: control
# (promote, a CI job) writes that one, and the fleet file names what a worker executes (a runtime's venv, flags).
FLEET_CONFIG_KEY = "_fleet"
# Settings of the shared fleet file that make a joining worker run a program or pass it arguments: a worker
# started with only --nats-url refuses them unless its own host consents (ENV_TRUST_FLEET_EXEC=1).
EXEC_OPTIONS = ("venv", "extra_args")
ENV_TRUST_FLEET_EXEC = "LORAFLEET_TRUST_FLEET_EXEC"
# A promotion's lock (`lorafleet promote`/`rollback`): held in the fleet bucket from before the champion is read
# until the fleet state is written, so two promotions of one name never interleave (registry/promote.py).
LOCK_PREFIX = "_lock."
# A promotion's staged entry (`lorafleet promote`): the new version under `_preload.NAME` while the workers of
# its base preload it, before the live entry NAME is written. Not a served name either, so gateways never
# route by it; workers turn it into a preload.
PRELOAD_PREFIX = "_preload."
# Host-local settings stay out of the shared copy: each process gets its own URL, credential and TLS files
# on its command line, and API keys are secrets the workers (who can read the bucket) must not see.
_HOST_LOCAL: dict[str, Any] = {"nats_url": True, "nats": {"creds", "tls_ca", "tls_cert", "tls_key"},
                               "gateway": {"api_keys"}}


class FleetStateError(RuntimeError):
    """The fleet state cannot be read or written (NATS unreachable, bucket missing, bad entry)."""


DEFAULT_RETAIN_S = 7 * 24 * 3600.0
DEFAULT_RETAIN_VERSIONS = 2
RETIRED_KEPT = 64  # retired version numbers remembered per name (for 410 rather than 404); the oldest go first


class RetainedVersion(StrictModel):
    """A former champion still served under its pinned name NAME@N after a promote (issue 25): a client's index
    built with it keeps working until it has re-embedded with the new version."""

    version: str
    base: str
    adapter_id: str
    adapter_uri: str
    profile: ServingProfile | None = None
    kind: str | None = None
    system_prompt: str | None = None
    chat_template: str | None = None
    generation: dict[str, Any] | None = None
    superseded: float = Field(description="When it stopped being the champion (epoch seconds).")
    until: float | None = Field(None, description="Retired after this (epoch seconds); None: no time limit.")


class CanarySpec(StrictModel):
    """A canary of a promoted name (issue 25): `percent` of the plain name's traffic, by a sticky hash of each
    client's route key, goes to this version; the rest stays on the champion. In the fleet state so every gateway
    applies the same split and a restart keeps it. Written by `promote --canary`, removed by `--finish`/`--abort`."""

    version: str
    percent: float = Field(gt=0, lt=100)
    base: str
    adapter_id: str
    adapter_uri: str
    profile: ServingProfile | None = None
    kind: str | None = None
    system_prompt: str | None = None
    chat_template: str | None = None
    generation: dict[str, Any] | None = None
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
        return self.model_copy(update={
            "base": kept.base, "adapter_id": kept.adapter_id, "adapter_uri": kept.adapter_uri, "profile": kept.profile,
            "version": kept.version, "kind": kept.kind, "system_prompt": kept.system_prompt,
            "chat_template": kept.chat_template, "generation": kept.generation, "retained": [], "retired": []})

    def canary_as_entry(self, c: CanarySpec | None = None) -> FleetEntry | None:
        """The canary (or the spec `c`: the shadow) as the live entry it would be (what a gateway routes by)."""
        c = self.canary if c is None else c
        if c is None:
            return None
        return self.model_copy(update={
            "base": c.base, "adapter_id": c.adapter_id, "adapter_uri": c.adapter_uri, "profile": c.profile,
            "version": c.version, "kind": c.kind, "system_prompt": c.system_prompt, "chat_template": c.chat_template,
            "generation": c.generation, "retained": [], "retired": [], "canary": None, "shadow": None})

    def shadow_as_entry(self) -> FleetEntry | None:
        return self.canary_as_entry(self.shadow) if self.shadow is not None else None


def canary_spec(candidate: FleetEntry, percent: float, now: float | None = None) -> CanarySpec:
    """The canary that sends `percent` of the name's traffic to `candidate` (an entry as promote would write it)."""
    return CanarySpec(version=candidate.version, percent=percent, base=candidate.base,
                      adapter_id=candidate.adapter_id, adapter_uri=candidate.adapter_uri, profile=candidate.profile,
                      kind=candidate.kind, system_prompt=candidate.system_prompt,
                      chat_template=candidate.chat_template, generation=candidate.generation,
                      started=time.time() if now is None else now)


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
        kept.insert(0, RetainedVersion(
            version=old.version, base=old.base, adapter_id=old.adapter_id, adapter_uri=old.adapter_uri,
            profile=old.profile, kind=old.kind, system_prompt=old.system_prompt, chat_template=old.chat_template,
            generation=old.generation, superseded=now, until=until))
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


async def ensure_fleet_bucket(js: Any, bucket: str = FLEET_KV_BUCKET, *, replicas: int = 1) -> Any:
    """The fleet KV bucket, created if missing (gateways and workers call this at start; idempotent).

    `replicas`: copies on a JetStream cluster (FleetConfig.nats.replicas); an existing bucket keeps its own."""
    from nats.js.api import KeyValueConfig
    from nats.js.errors import BucketNotFoundError

    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        pass
    with contextlib.suppress(Exception):  # another process may create it at the same moment
        return await js.create_key_value(
            KeyValueConfig(bucket=bucket, history=16, description="lorafleet desired fleet state", replicas=replicas))
    return await js.key_value(bucket)


async def open_fleet_bucket(js: Any, bucket: str = FLEET_KV_BUCKET) -> Any:
    """The existing fleet KV bucket; FleetStateError when it is missing (the cluster never created it)."""
    from nats.js.errors import BucketNotFoundError

    try:
        return await js.key_value(bucket)
    except BucketNotFoundError as exc:
        raise FleetStateError(
            f"the NATS KV bucket {bucket!r} does not exist on this server: no lorafleet gateway or worker has "
            "started against it. Start the cluster with `lorafleet up` (or pass the right --nats-url)."
        ) from exc


def shared_fleet_config(fleet: FleetConfig) -> bytes:
    """The fleet file as other hosts' processes get it: JSON, without the host-local settings (_HOST_LOCAL)."""
    return json.dumps(fleet.model_dump(mode="json", exclude=_HOST_LOCAL), indent=1).encode()


async def ensure_config_bucket(js: Any, *, replicas: int = 1) -> Any:
    """The bucket of the fleet file, created if missing: `lorafleet up` with the admin credential (no other role
    may create or write it)."""
    return await ensure_fleet_bucket(js, FLEET_CONFIG_KV_BUCKET, replicas=replicas)


async def put_fleet_config(kv: Any, fleet: FleetConfig) -> int:
    """Publish the fleet file (what `lorafleet up` serves) for processes that join from other hosts; `kv` is the
    config bucket (ensure_config_bucket)."""
    return await kv.put(FLEET_CONFIG_KEY, shared_fleet_config(fleet))


async def purge_legacy_fleet_config(fleet_kv: Any) -> None:
    """Remove the fleet file that versions before the config bucket kept in the fleet bucket (admin, at `up`)."""
    from nats.js.errors import KeyDeletedError, KeyNotFoundError

    try:
        await fleet_kv.get(FLEET_CONFIG_KEY)
    except (KeyNotFoundError, KeyDeletedError):
        return
    await fleet_kv.purge(FLEET_CONFIG_KEY)


def exec_settings(fleet: FleetConfig) -> list[str]:
    """Where a fleet file names a program to run or arguments to pass it (`bases[NAME].options.venv`, …)."""
    return [f"bases[{b.name}].options.{k}" for b in fleet.bases for k in EXEC_OPTIONS if b.options.get(k)]


def check_exec_consent(fleet: FleetConfig, allow: bool | None = None) -> FleetConfig:
    """The fleet file read from NATS, refused when it names programs or flags and this host did not consent
    (`allow`, default: ENV_TRUST_FLEET_EXEC=1): whoever can write the bucket must not choose what runs here."""
    if allow is None:
        allow = os.environ.get(ENV_TRUST_FLEET_EXEC, "").strip().lower() in ("1", "true", "yes")
    named = exec_settings(fleet)
    if named and not allow:
        raise FleetStateError(
            f"the fleet file in NATS sets {', '.join(named)}: a process that joins with only --nats-url does not run "
            f"programs or flags the NATS server names. Pass --fleet FLEET.yaml (this host's own copy), or set "
            f"{ENV_TRUST_FLEET_EXEC}=1 on this host to accept them.")
    return fleet


NO_FLEET_FILE = ("this NATS server holds no fleet file: the cluster was not started by `lorafleet up` (which "
                 "publishes it), or it was deleted. Pass --fleet FLEET.yaml.")


async def read_fleet_config(kv: Any) -> FleetConfig:
    """The fleet file `lorafleet up` published; FleetStateError when there is none or it does not validate."""
    from nats.js.errors import KeyNotFoundError

    try:
        entry = await kv.get(FLEET_CONFIG_KEY)
    except KeyNotFoundError as exc:
        raise FleetStateError(NO_FLEET_FILE) from exc
    try:
        return validate_model(FleetConfig, json.loads(entry.value), source=f"NATS KV {FLEET_CONFIG_KEY}")
    except (ConfigError, ValueError) as exc:
        raise FleetStateError(f"the fleet file in NATS is not valid: {exc}; pass --fleet FLEET.yaml") from exc


def fetch_fleet_config(url: str, options: dict[str, Any], timeout: float = 10.0, *, allow_exec: bool | None = None
                       ) -> FleetConfig:
    """The fleet file published in NATS (`lorafleet up` does), read once at start by a process on another host;
    refused when it names programs to run without this host's consent (check_exec_consent)."""
    import nats

    async def fetch() -> FleetConfig:
        try:
            nc = await asyncio.wait_for(
                nats.connect(server_urls(url), allow_reconnect=False, connect_timeout=5, **options), timeout)
        except Exception as exc:
            raise FleetStateError(f"cannot read the fleet file from NATS at {url}: {exc!r}") from exc
        try:
            try:
                kv = await open_fleet_bucket(nc.jetstream(), FLEET_CONFIG_KV_BUCKET)
            except FleetStateError as exc:
                raise FleetStateError(NO_FLEET_FILE) from exc
            return await read_fleet_config(kv)
        finally:
            await nc.close()

    return check_exec_consent(asyncio.run(fetch()), allow_exec)


async def read_entries(kv: Any) -> dict[str, FleetEntry]:
    from nats.js.errors import NoKeysError

    try:
        keys = await kv.keys()
    except NoKeysError:
        return {}
    out = {}
    for key in keys:
        if not is_served_key(key):  # the fleet file, staged preloads
            continue
        with contextlib.suppress(Exception):
            out[key] = FleetEntry.from_bytes((await kv.get(key)).value)
    return out


async def put_entry(kv: Any, entry: FleetEntry) -> int:
    return await kv.put(entry.name, entry.to_bytes())


async def read_entry(kv: Any, name: str) -> tuple[FleetEntry | None, int]:
    """The live entry of `name` (None: none, or deleted) and the key's last revision (0: never written), for
    `write_entry(…, last=)`."""
    from nats.js.errors import KeyNotFoundError

    try:
        got = await kv.get(name)
    except KeyNotFoundError as exc:  # nats-py: a deleted key's marker comes with it, never written: none
        return None, exc.entry.revision if exc.entry is not None else 0
    try:
        return FleetEntry.from_bytes(got.value), got.revision
    except Exception:  # a bad entry is replaced like a missing one, but only at this revision
        return None, got.revision


class FleetStateConflict(FleetStateError):
    """Someone wrote the entry after it was read: the write was refused."""


async def write_entry(kv: Any, entry: FleetEntry, last: int) -> int:
    """Write the live entry only if the key is still at revision `last` (compare-and-set); FleetStateConflict
    if anyone wrote it in between."""
    from nats.js.errors import KeyWrongLastSequenceError

    try:
        return await kv.update(entry.name, entry.to_bytes(), last=last)
    except KeyWrongLastSequenceError as exc:
        raise FleetStateConflict(f"the fleet state of {entry.name} was changed by someone else after it was read "
                                 f"(expected revision {last})") from exc


async def delete_entry(kv: Any, name: str) -> None:
    await kv.delete(name)


async def put_staged(kv: Any, entry: FleetEntry) -> int:
    """Ask the workers of `entry.base` to preload its adapter (the live entry comes after)."""
    return await kv.put(preload_key(entry.name), entry.to_bytes())


async def delete_staged(kv: Any, name: str) -> None:
    await kv.delete(preload_key(name))


OnChange = Callable[[dict[str, FleetEntry]], None]
OnStaged = Callable[[FleetEntry], None]


class FleetWatcher:
    """Keeps the current fleet table from the KV bucket and calls `on_change(table)` after each change.

    The callback runs on the event loop with a fresh dict, so it may keep it without copying. Staged
    preloads never enter the table; `on_staged(entry)` (workers) is called for each one written, on the loop.
    """

    def __init__(self, js: Any, on_change: OnChange, bucket: str = FLEET_KV_BUCKET, *, replicas: int = 1,
                 on_staged: OnStaged | None = None) -> None:
        self.js = js
        self.replicas = replicas  # when the bucket is missing and this process creates it
        self.on_change = on_change
        self.on_staged = on_staged
        self.bucket = bucket
        self.table: dict[str, FleetEntry] = {}
        self.initialised = asyncio.Event()
        self._watcher: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        kv = await ensure_fleet_bucket(self.js, self.bucket, replicas=self.replicas)
        self._watcher = await kv.watchall()
        self._task = asyncio.create_task(self._run(), name="lorafleet-fleet-watch")

    async def _run(self) -> None:
        async for entry in self._watcher:
            if entry is None:  # end of the initial values
                self._mark_initialised()
                continue
            if entry.key.startswith(PRELOAD_PREFIX):
                self._staged(entry)
                continue
            if not is_served_key(entry.key):  # the fleet file, not a served name
                continue
            if entry.operation in ("DEL", "PURGE"):
                self.table.pop(entry.key, None)
            else:
                try:
                    self.table[entry.key] = FleetEntry.from_bytes(entry.value)
                except Exception as exc:  # a bad entry must not stop the watch
                    log.warning("ignoring fleet state entry %s: %s", entry.key, exc)
                    continue
            if self.initialised.is_set():
                self._emit()

    def _staged(self, entry: Any) -> None:
        if self.on_staged is None or entry.operation in ("DEL", "PURGE"):
            return
        try:
            self.on_staged(FleetEntry.from_bytes(entry.value))
        except Exception as exc:  # a bad entry must not stop the watch
            log.warning("ignoring staged fleet state entry %s: %s", entry.key, exc)

    def _mark_initialised(self) -> None:
        if not self.initialised.is_set():
            self.initialised.set()
            self._emit()

    def _emit(self) -> None:
        try:
            self.on_change(dict(self.table))
        except Exception:
            log.exception("fleet state callback failed")

    async def wait_initialised(self, timeout: float = 5.0) -> None:
        await asyncio.wait_for(self.initialised.wait(), timeout)

    async def stop(self) -> None:
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
