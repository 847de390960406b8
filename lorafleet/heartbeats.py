"""Listening to worker heartbeats: one subscription helper for the gateway, status, promote and benchmarks.

Heartbeats say which workers are alive and what they hold; they are never used for routing (workers
pull). A malformed heartbeat is dropped quietly: a stray message must not break a listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from lorafleet.wire import HEARTBEAT_PREFIX, Heartbeat, WireError

log = logging.getLogger(__name__)

HEARTBEAT_SUBJECT = f"{HEARTBEAT_PREFIX}.>"


async def subscribe(nc: Any, on_heartbeat: Callable[[Heartbeat], None]) -> Any:
    """Call `on_heartbeat` (on the event loop) for every valid heartbeat; returns the subscription."""

    async def handler(msg: Any) -> None:
        try:
            hb = Heartbeat.from_wire(msg.data)
        except WireError:
            log.debug("ignoring a malformed heartbeat on %s", msg.subject)
            return
        on_heartbeat(hb)

    return await nc.subscribe(HEARTBEAT_SUBJECT, cb=handler)


async def collect(nc: Any, listen_s: float, *, until: Callable[[dict[str, Heartbeat]], bool] | None = None
                  ) -> dict[str, Heartbeat]:
    """The latest heartbeat of every worker heard within `listen_s` (earlier once `until(seen)` holds)."""
    seen: dict[str, Heartbeat] = {}
    done = asyncio.Event()

    def on_hb(hb: Heartbeat) -> None:
        seen[hb.worker] = hb
        if until is not None and until(seen):
            done.set()

    sub = await subscribe(nc, on_hb)
    try:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), listen_s)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return seen
