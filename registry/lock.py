"""One promotion (or rollback) of a name at a time: a lock key in the fleet KV bucket.

`kv.create(_lock.NAME)` succeeds only when the key does not exist (JetStream checks the expected last
sequence of the subject), so of two promotions that start together exactly one gets it. The value says who
holds it and until when; the holder renews it (compare-and-set on its own revision) every `renew_s`, so a
promotion that was killed (no `finally` ran) blocks the name for at most `ttl_s`, after which the next one
takes it over, again by compare-and-set so that two takers cannot both win. Clocks of different hosts only
need to agree to within the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from lorafleet.fleet_state import LOCK_PREFIX

log = logging.getLogger(__name__)

LOCK_TTL_S = 30.0
RENEW_S = 5.0


class LockBusy(RuntimeError):
    """Another live promotion holds the name."""

    def __init__(self, name: str, holder: LockRecord | None) -> None:
        self.name, self.holder = name, holder
        who = f" ({holder.describe()})" if holder is not None else ""
        super().__init__(f"another promote of {name} is in progress{who}; nothing changed. Run it again when "
                         "that one has finished")


class LockLost(RuntimeError):
    """The lock could not be renewed (NATS gone, or it expired and was taken over)."""


@dataclass(frozen=True)
class LockRecord:
    """The lock key's value: who holds it, doing what, until when (epoch seconds)."""

    owner: str
    action: str
    host: str
    pid: int
    since: float
    expires: float

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LockRecord | None:
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError):
            return None  # unreadable: treated as expired

    def describe(self) -> str:
        return (f"a {self.action} by pid {self.pid} on {self.host} since "
                f"{time.strftime('%H:%M:%S', time.localtime(self.since))}, held until "
                f"{time.strftime('%H:%M:%S', time.localtime(self.expires))} unless renewed")


def lock_key(name: str) -> str:
    return f"{LOCK_PREFIX}{name}"


@dataclass
class HeldLock:
    name: str
    record: LockRecord
    revision: int
    lost: BaseException | None = None

    def ensure(self) -> None:
        """Raise LockLost when the lock was not kept: nothing may be changed without it."""
        if self.lost is not None:
            raise LockLost(f"the promote lock of {self.name} was lost ({self.lost}); nothing was changed")


async def _acquire(kv: Any, name: str, record: LockRecord) -> int:
    from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError

    key = lock_key(name)
    for _ in range(3):  # a holder may release between our create and our read: try again
        try:
            return await kv.create(key, record.to_bytes())
        except KeyWrongLastSequenceError:
            pass
        try:
            current = await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            continue
        held = LockRecord.from_bytes(current.value)
        if held is not None and held.expires > time.time():
            raise LockBusy(name, held)
        try:  # expired: take it over, unless someone else just did
            revision = await kv.update(key, record.to_bytes(), last=current.revision)
        except KeyWrongLastSequenceError:
            continue
        log.warning("took over the expired promote lock of %s (%s)", name, held.describe() if held else "unreadable")
        return revision
    raise LockBusy(name, None)


async def _renew(kv: Any, held: HeldLock, ttl_s: float, renew_s: float) -> None:
    while True:
        await asyncio.sleep(renew_s)
        try:
            record = replace(held.record, expires=time.time() + ttl_s)
            held.revision = await kv.update(lock_key(held.name), record.to_bytes(), last=held.revision)
            held.record = record
        except Exception as exc:  # expired and taken over, or NATS gone: the holder must stop
            held.lost = exc
            return


@contextlib.asynccontextmanager
async def promote_lock(kv: Any, name: str, action: str, *, ttl_s: float = LOCK_TTL_S, renew_s: float = RENEW_S
                       ) -> AsyncIterator[HeldLock]:
    """Hold the promote lock of `name` for the block; LockBusy when another live promotion holds it."""
    now = time.time()
    record = LockRecord(owner=uuid.uuid4().hex, action=action, host=socket.gethostname(), pid=os.getpid(),
                        since=now, expires=now + ttl_s)
    held = HeldLock(name, record, await _acquire(kv, name, record))
    renewer = asyncio.create_task(_renew(kv, held, ttl_s, renew_s), name=f"lorafleet-promote-lock-{name}")
    try:
        yield held
    finally:
        renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewer
        with contextlib.suppress(Exception):  # only our own revision: never a lock someone took over
            await kv.delete(lock_key(name), last=held.revision)
