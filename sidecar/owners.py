"""Is anyone still waiting for a task's answer? The gateway that published it listens on its reply inbox.

NATS answers a request to a subject nobody subscribes to at once with "no responders", so the
inbox itself says whether its gateway is there; a probe is an empty request to the task's own
reply subject, which the gateway confirms like a result (and otherwise ignores). What a worker
learns from a failed reply (no responders) is recorded too, so after the first orphaned task
the others of that gateway are recognised without computing them.

A gateway that is merely reconnecting (nats-server restarted) has no subscription for a moment:
an owner is `AWAY` first, and `GONE` only once it has been away for `grace_s` — its tasks are then
dropped instead of computed again for nobody. Any answer makes it `ALIVE` again. A probe that
gets no answer at all (timeout) says nothing and counts as alive.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any

from nats.errors import NoRespondersError

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
PROBE_TTL_S = 0.5  # a probe's verdict is reused this long for every task of the same gateway
FORGET_S = 300.0  # owners not heard of for this long are forgotten (the table stays small)


class Owner(StrEnum):
    ALIVE = "alive"
    AWAY = "away"
    GONE = "gone"


def owner_of(reply: str) -> str:
    """The gateway's inbox prefix of a reply subject `<prefix>.<request id>`."""
    return reply.rsplit(".", 1)[0]


class _Seen:
    __slots__ = ("absent_since", "checked")

    def __init__(self) -> None:
        self.absent_since: float | None = None
        self.checked = 0.0


class OwnerTracker:
    """Per gateway inbox prefix: present, or absent since when. `request(subject, body, timeout)` is the
    connection's request (tests pass a fake)."""

    def __init__(self, request: Callable[..., Awaitable[Any]], grace_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.request = request
        self.grace_s = grace_s
        self.clock = clock
        self._seen: dict[str, _Seen] = {}
        self._probes: dict[str, asyncio.Future[None]] = {}
        self._gone_logged: set[str] = set()
        self.dropped = 0

    def heard(self, reply: str, present: bool) -> None:
        """What a reply to `reply` showed: confirmed (present) or no responders (absent)."""
        now = self.clock()
        seen = self._seen.setdefault(owner_of(reply), _Seen())
        seen.checked = now
        if present:
            seen.absent_since = None
        elif seen.absent_since is None:
            seen.absent_since = now
        if len(self._seen) > 1024:
            self._forget(now)

    def away_for(self, reply: str) -> float | None:
        """Seconds since this owner was first found absent (None: not absent when last heard of)."""
        seen = self._seen.get(owner_of(reply))
        if seen is None or seen.absent_since is None:
            return None
        return self.clock() - seen.absent_since

    def suspect(self, reply: str) -> bool:
        """Whether this owner was absent when last heard of (then its tasks are checked before compute)."""
        seen = self._seen.get(owner_of(reply))
        return seen is not None and seen.absent_since is not None

    async def status(self, reply: str) -> Owner:
        """The owner's state now, probing its inbox unless it was heard of within PROBE_TTL_S."""
        prefix = owner_of(reply)
        seen = self._seen.get(prefix)
        if seen is None or self.clock() - seen.checked > PROBE_TTL_S:
            await self._probe(prefix, reply)
            seen = self._seen.get(prefix)
        if seen is None or seen.absent_since is None:
            return Owner.ALIVE
        if self.clock() - seen.absent_since < self.grace_s:
            return Owner.AWAY
        if prefix not in self._gone_logged:
            self._gone_logged.add(prefix)
            log.info("nobody has listened on %s for %.1fs: its gateway is gone; dropping its tasks uncomputed",
                     prefix, self.clock() - seen.absent_since)
        return Owner.GONE

    async def _probe(self, prefix: str, reply: str) -> None:
        running = self._probes.get(prefix)
        if running is not None:  # one probe per gateway at a time; the others wait for its verdict
            await asyncio.shield(running)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._probes[prefix] = fut
        try:
            await self.request(reply, b"", timeout=PROBE_TIMEOUT_S)
            self.heard(reply, True)
        except NoRespondersError:
            self.heard(reply, False)
        except Exception as exc:  # a timeout or a connection problem says nothing about the gateway
            log.debug("probe of %s inconclusive: %r", prefix, exc)
            self._seen.setdefault(prefix, _Seen()).checked = self.clock()
        finally:
            del self._probes[prefix]
            fut.set_result(None)

    def _forget(self, now: float) -> None:
        for prefix in [p for p, s in self._seen.items() if now - s.checked > FORGET_S]:
            del self._seen[prefix]
