"""One promotion (or rollback) of a name at a time: a lock key in the fleet KV bucket.

`kv.create(_lock.NAME)` succeeds only when the key does not exist (JetStream checks the expected last
sequence of the subject), so of two promotions that start together exactly one gets it. The value says who
holds it and until when; the holder renews it (compare-and-set on its own revision) every `renew_s`, so a
promotion that was killed (no `finally` ran) blocks the name for at most `ttl_s`, after which the next one
takes it over, again by compare-and-set so that two takers cannot both win. Clocks of different hosts only
need to agree to within the TTL.

A holder checks that it still holds the lock (`HeldLock.verify`: the key still carries its owner id and has not
expired) after every slow step and before every write (registry/writes.py): a holder that stalled past the TTL
(a suspended process, a slow store) finds out before it writes over what the next holder did. Someone who must
act soon on a name whose lock is held (the canary watch's abort) waits for the release on the key's KV watch
(`wait_released`), not by sleeping.
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
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lorafleet.core.fleet_state import LOCK_PREFIX

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
    kv: Any = field(default=None, repr=False)  # the bucket it lives in, for `verify`

    def ensure(self) -> None:
        """Raise LockLost when the lock was not kept (a renewal failed, or its time ran out before one came):
        nothing may be changed without it."""
        if self.lost is not None:
            raise LockLost(f"the promote lock of {self.name} was lost ({self.lost}); nothing more was changed")
        if time.time() >= self.record.expires:
            raise LockLost(f"the promote lock of {self.name} expired before it was renewed (this process stalled "
                           "for longer than its time to live); nothing more was changed")

    async def verify(self) -> None:
        """`ensure`, then read the key: LockLost unless it still names this holder (taken over, deleted). By owner
        id, not revision: a renewal in flight changes the revision, never the owner."""
        self.ensure()
        if self.kv is None:
            return
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        try:
            current = await self.kv.get(lock_key(self.name))
        except (KeyNotFoundError, KeyDeletedError) as exc:
            self.lost = exc
            raise LockLost(f"the promote lock of {self.name} is gone (deleted by hand or expired and released by "
                           "another); nothing more was changed") from exc
        held = LockRecord.from_bytes(current.value)
        if held is None or held.owner != self.record.owner:
            self.lost = LockLost("taken over")
            who = held.describe() if held is not None else "an unreadable record"
            raise LockLost(f"the promote lock of {self.name} was taken over ({who}) while this one stalled; "
                           "nothing more was changed")


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
async def promote_lock(kv: Any, name: str, action: str, *, ttl_s: float | None = None, renew_s: float | None = None
                       ) -> AsyncIterator[HeldLock]:
    """Hold the promote lock of `name` for the block; LockBusy when another live promotion holds it. `ttl_s` and
    `renew_s` default to LOCK_TTL_S and RENEW_S as they are at the call."""
    ttl_s = LOCK_TTL_S if ttl_s is None else ttl_s
    renew_s = RENEW_S if renew_s is None else renew_s
    now = time.time()
    record = LockRecord(owner=uuid.uuid4().hex, action=action, host=socket.gethostname(), pid=os.getpid(),
                        since=now, expires=now + ttl_s)
    held = HeldLock(name, record, await _acquire(kv, name, record), kv=kv)
    renewer = asyncio.create_task(_renew(kv, held, ttl_s, renew_s), name=f"lorafleet-promote-lock-{name}")
    try:
        yield held
    finally:
        renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewer
        with contextlib.suppress(Exception):  # only our own revision: never a lock someone took over
            await kv.delete(lock_key(name), last=held.revision)


@contextlib.asynccontextmanager
async def locked(kv: Any, name: str, action: str, error: type[Exception] | None) -> AsyncIterator[HeldLock]:
    """`promote_lock` for the block, LockBusy and LockLost raised as `error` (None: as they are, for a caller that
    waits and tries again)."""
    try:
        async with promote_lock(kv, name, action) as lock:
            yield lock
    except (LockBusy, LockLost) as exc:
        if error is None:
            raise
        raise error(str(exc)) from exc


async def wait_released(kv: Any, name: str, timeout_s: float) -> bool:
    """Wait, on a KV watch of the lock key, until `name`'s lock can be taken: deleted, unreadable, or past its
    expiry (a holder that died). True when it can, False when `timeout_s` passed first."""
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.kv import KV_DEL, KV_PURGE

    deadline = time.monotonic() + timeout_s
    watcher = await kv.watch(lock_key(name))
    seen = False  # the watch replays the key's current value first, then None
    expires: float | None = None
    try:
        while True:
            if expires is not None and expires <= time.time():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if expires is not None:
                left = min(left, max(0.01, expires - time.time()))
            try:
                update = await watcher.updates(timeout=left)
            except NatsTimeout:
                continue
            if update is None:
                if not seen:
                    return True  # no lock key at all
                continue
            seen = True
            if update.operation in (KV_DEL, KV_PURGE):
                return True
            held = LockRecord.from_bytes(update.value or b"")
            if held is None:
                return True
            expires = held.expires
    finally:
        with contextlib.suppress(Exception):
            await watcher.stop()
