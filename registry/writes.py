"""The writes of a name's state, one function each, so that every transition makes them the same way.

A promotion, rollback, canary, shadow or repair changes up to three stores: the registry's `champion` alias and
its history (MLflow), and the name's live entry in the fleet bucket (NATS KV), which gateways and workers
follow. Every write here:

- checks the promote lock first (`HeldLock.verify`): a holder that stalled until another took the name over
  writes nothing more (LockLost);
- runs a blocking registry call in a thread it waits for even when cancelled (`in_thread`): a thread cannot be
  stopped, so what it wrote is known before anything is undone;
- for the fleet entry, by compare-and-set, resolves a failure it cannot judge (a lost ack, a cancellation while
  the request was in flight) by reading the entry back (`write_fleet`): stored means done, whatever the error
  said; not stored means `undo` runs; anything else is reported as unknown, never guessed.

The transition path and where a crash can land are in docs/architecture.md ("Promotion as a state machine").

Tests interrupt a transition right after any write through `hooked` (off by default): the hook is called with
(step, "before"|"after") around each write, steps "alias", "history" and "fleet", and "read" after a
transition's last read before its first write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, Literal, TypeVar

from lorafleet.core.fleet_state import FleetEntry, FleetStateConflict, FleetStateError, write_entry
from lorafleet.registry import store
from lorafleet.registry.lock import HeldLock
from lorafleet.registry.store import CHAMPION

log = logging.getLogger(__name__)

T = TypeVar("T")
Step = Literal["alias", "history", "fleet", "read"]
Phase = Literal["before", "after"]
Hook = Callable[[str, str], None]

READ_BACK_S = 5.0  # how long the read-back of an ambiguous fleet write may take before the outcome is "unknown"

_hook: Hook | None = None


@contextlib.contextmanager
def hooked(hook: Hook) -> Iterator[None]:
    """Tests only: call `hook(step, phase)` around every write of this process while the block runs."""
    global _hook
    before, _hook = _hook, hook
    try:
        yield
    finally:
        _hook = before


class Killed(BaseException):
    """Tests: stands for the process dying right after a write (`interrupted_after(..., kill=True)`)."""


@contextlib.contextmanager
def interrupted_after(step: Step, *, nth: int = 1, exc: BaseException | None = None, kill: bool = False
                      ) -> Iterator[list[int]]:
    """Tests only: raise `exc` (default KeyboardInterrupt) right after the `nth` write of `step` in this block.
    With `kill`, raise Killed there and at every later write, as if the process had died: nothing it would still
    do (an undo) reaches any store. Yields a list that holds the count of `step` writes seen."""
    seen = [0]
    dead = [False]

    def hook(at: str, phase: str) -> None:
        if dead[0] and phase == "before":
            raise Killed(f"dead since the write of {step}: no {at} write")
        if at == step and phase == "after":
            seen[0] += 1
            if seen[0] == nth:
                if kill:
                    dead[0] = True
                    raise Killed(f"killed right after write {nth} of {step}")
                raise exc if exc is not None else KeyboardInterrupt(f"interrupted right after the write of {step}")

    with hooked(hook):
        yield seen


def reached(step: Step, phase: Phase = "after") -> None:
    """The hook point of `step` (a no-op unless a test installed a hook)."""
    if _hook is not None:
        _hook(step, phase)


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a thread; when the caller is cancelled meanwhile, wait for the thread to end first (what it
    wrote must be known before anything is undone), then re-raise the cancellation."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await task
        raise


async def _checked(lock: HeldLock | None, step: Step) -> None:
    reached(step, "before")
    if lock is not None:
        await lock.verify()


def _set_alias(name: str, version: str | None) -> None:
    if version is None:
        store.delete_alias(name, CHAMPION)
    else:
        store.set_alias(name, CHAMPION, version)


async def write_alias(lock: HeldLock | None, name: str, version: str | None) -> None:
    """Point `champion` of `name` at `version` (None: remove it)."""
    await _checked(lock, "alias")
    await in_thread(_set_alias, name, version)
    reached("alias")


async def write_history(lock: HeldLock | None, name: str, history: tuple[str, ...]) -> None:
    await _checked(lock, "history")
    await in_thread(store.set_champion_history, name, list(history))
    reached("history")


async def landed(kv: Any, entry: FleetEntry, last: int) -> tuple[bool | None, int]:
    """After a write of `entry` over revision `last` failed: (True, its revision) when the bucket holds exactly
    it, False when the key is still at `last` (nothing was written), None when it cannot tell (unreadable, or
    someone wrote something else since)."""
    from nats.js.errors import KeyNotFoundError

    try:
        got = await asyncio.wait_for(kv.get(entry.name), READ_BACK_S)
    except KeyNotFoundError as exc:
        revision = exc.entry.revision if exc.entry is not None else 0
        return (False if revision == last else None), revision
    except BaseException:  # a read-back that fails (or is cancelled) leaves the outcome unknown
        return None, 0
    if got.revision > last and got.value == entry.to_bytes():
        return True, int(got.revision)
    return (False if got.revision == last else None), int(got.revision)


async def write_fleet(lock: HeldLock | None, kv: Any, entry: FleetEntry, last: int, *,
                      undo: Callable[[], Awaitable[None]] | None = None) -> int:
    """Compare-and-set `entry` over revision `last`; its new revision. On any failure (a BaseException too) the
    entry is read back: stored means it is done (an Exception is then logged and the revision returned; a
    BaseException is re-raised, the write stands); not stored runs `undo` (the writes before it) and re-raises;
    unknown re-raises as FleetStateError saying so, with nothing undone (`registry check --repair` settles it)."""
    await _checked(lock, "fleet")
    try:
        revision = await write_entry(kv, entry, last=last)
        reached("fleet")
        return revision
    except BaseException as exc:
        stored, revision = (False, last) if isinstance(exc, FleetStateConflict) else await landed(kv, entry, last)
        if stored is True:
            if not isinstance(exc, Exception):
                raise
            log.warning("%s: the fleet state write reported %r, but reading it back shows it stored: done",
                        entry.name, exc)
            return revision
        if stored is None:
            if not isinstance(exc, Exception):
                raise
            raise FleetStateError(
                f"could not tell whether the fleet state of {entry.name} (v{entry.version}) was written ({exc}); "
                f"nothing was undone. Run `lorafleet registry check {entry.name} --repair`") from exc
        if undo is not None:
            try:
                await undo()
            except BaseException as undo_exc:  # the first failure is the one to report
                log.error("%s: undoing after the failed fleet state write failed too: %r", entry.name, undo_exc)
                if isinstance(exc, Exception):
                    raise FleetStateError(
                        f"writing the fleet state of {entry.name} failed ({exc}) and undoing the registry's part "
                        f"failed too ({undo_exc}); run `lorafleet registry check {entry.name} --repair`") from exc
                raise
        if isinstance(exc, Exception) and not isinstance(exc, FleetStateError):
            what = ", alias restored" if undo is not None else ", nothing changed"
            raise FleetStateError(f"writing the fleet state of {entry.name} failed{what}: {exc}") from exc
        raise


def run_transition(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)`, with SIGTERM handled like Ctrl-C when called from the main thread: the transition is
    cancelled where it stands, so its undo runs (a plain SIGTERM would end the process between two writes).
    The process then exits with status 143."""
    stopped: list[int] = []

    async def main() -> T:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        installed = False
        if task is not None and threading.current_thread() is threading.main_thread():
            def stop() -> None:
                stopped.append(signal.SIGTERM)
                task.cancel()
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(signal.SIGTERM, stop)
                installed = True
        try:
            return await coro
        finally:
            if installed:
                loop.remove_signal_handler(signal.SIGTERM)

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        if stopped:
            raise SystemExit(128 + signal.SIGTERM) from None
        raise


__all__ = ["Hook", "Killed", "hooked", "in_thread", "interrupted_after", "landed", "reached", "run_transition",
           "write_alias", "write_fleet", "write_history"]
