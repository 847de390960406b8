"""The desired fleet state in NATS: one KV entry per promoted served name, watched by gateways and workers, and
the fleet file published beside it for hosts that join.

Key = the served name (e.g. `german-legal`); value = JSON of `FleetEntry` (JSON, not MessagePack,
so `nats kv get lorafleet_fleet german-legal` is readable by a person). Gateways turn the table into
routes (served name → base + adapter id + adapter URI); workers take each entry's serving profile
and fetch the adapter from its URI on first use. The adapter id carries the version
(`german-legal@v3`), so tasks already queued for the old version still name the old adapter and
finish on it while new requests use the new one. What an entry holds is fleet_entry.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from lorafleet.core.config import ConfigError, FleetConfig, validate_model

# The entry model and its pure rules live in fleet_entry.py; re-exported here, where callers name them.
from lorafleet.core.fleet_entry import KEY_RE as KEY_RE
from lorafleet.core.fleet_entry import LOCK_PREFIX as LOCK_PREFIX
from lorafleet.core.fleet_entry import PRELOAD_PREFIX, FleetEntry, FleetStateError, is_served_key, preload_key
from lorafleet.core.fleet_entry import CanaryInProgress as CanaryInProgress
from lorafleet.core.fleet_entry import CanarySpec as CanarySpec
from lorafleet.core.fleet_entry import RetainedVersion as RetainedVersion
from lorafleet.core.fleet_entry import Retention as Retention
from lorafleet.core.fleet_entry import ShadowSpec as ShadowSpec
from lorafleet.core.fleet_entry import adapter_id_for as adapter_id_for
from lorafleet.core.fleet_entry import by_adapter_id as by_adapter_id
from lorafleet.core.fleet_entry import canary_in_progress as canary_in_progress
from lorafleet.core.fleet_entry import canary_spec as canary_spec
from lorafleet.core.fleet_entry import merge_models as merge_models
from lorafleet.core.fleet_entry import refuse_during_canary as refuse_during_canary
from lorafleet.core.fleet_entry import retained_live as retained_live
from lorafleet.core.fleet_entry import route_bucket as route_bucket
from lorafleet.core.fleet_entry import served_models as served_models
from lorafleet.core.fleet_entry import takes_canary as takes_canary
from lorafleet.core.fleet_entry import with_retention as with_retention
from lorafleet.core.urls import server_urls
from lorafleet.core.wire import FLEET_CONFIG_KV_BUCKET, FLEET_KV_BUCKET

log = logging.getLogger(__name__)

# The fleet file itself, for processes on other hosts (`lorafleet worker`/`gateway` without --fleet): the key in
# its own bucket (FLEET_CONFIG_KV_BUCKET), which only the admin role may write. Not in the fleet bucket: control
# (promote, a CI job) writes that one, and the fleet file names what a worker executes (a runtime's venv, flags).
FLEET_CONFIG_KEY = "_fleet"
# Settings of the shared fleet file that make a joining worker run a program or pass it arguments: a worker
# started with only --nats-url refuses them unless its own host consents (ENV_TRUST_FLEET_EXEC=1).
EXEC_OPTIONS = ("venv", "extra_args")
ENV_TRUST_FLEET_EXEC = "LORAFLEET_TRUST_FLEET_EXEC"
# Host-local settings stay out of the shared copy: each process gets its own URL, credential and TLS files
# on its command line, and API keys are secrets the workers (who can read the bucket) must not see.
_HOST_LOCAL: dict[str, Any] = {"nats_url": True, "nats": {"creds", "tls_ca", "tls_cert", "tls_key"},
                               "gateway": {"api_keys"}}


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
