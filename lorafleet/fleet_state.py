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
import json
import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

from pydantic import Field

from lorafleet.config import ServedModel, ServingProfile, StrictModel
from lorafleet.wire import FLEET_KV_BUCKET

log = logging.getLogger(__name__)

KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class FleetStateError(RuntimeError):
    """The fleet state cannot be read or written (NATS unreachable, bucket missing, bad entry)."""


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

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> FleetEntry:
        return cls.model_validate(json.loads(data))

    def served_model(self) -> ServedModel:
        return ServedModel(name=self.name, base=self.base, adapter=self.adapter_uri, adapter_id=self.adapter_id,
                           profile=self.profile)


def adapter_id_for(name: str, version: str | int) -> str:
    return f"{name}@v{version}"


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
    """What a worker needs per adapter id: URI and serving profile of every promoted version."""
    return {e.adapter_id: e.served_model() for e in entries}


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


async def read_entries(kv: Any) -> dict[str, FleetEntry]:
    from nats.js.errors import NoKeysError

    try:
        keys = await kv.keys()
    except NoKeysError:
        return {}
    out = {}
    for key in keys:
        with contextlib.suppress(Exception):
            out[key] = FleetEntry.from_bytes((await kv.get(key)).value)
    return out


async def put_entry(kv: Any, entry: FleetEntry) -> int:
    return await kv.put(entry.name, entry.to_bytes())


async def delete_entry(kv: Any, name: str) -> None:
    await kv.delete(name)


OnChange = Callable[[dict[str, FleetEntry]], None]


class FleetWatcher:
    """Keeps the current fleet table from the KV bucket and calls `on_change(table)` after each change.

    The callback runs on the event loop with a fresh dict, so it may keep it without copying.
    """

    def __init__(self, js: Any, on_change: OnChange, bucket: str = FLEET_KV_BUCKET, *, replicas: int = 1) -> None:
        self.js = js
        self.replicas = replicas  # when the bucket is missing and this process creates it
        self.on_change = on_change
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
