"""Keeping this worker's durable consumers in place: self-healing when the stream or a consumer vanishes.

A worker cannot create the work stream (docs/security.md): it waits for it (`lorafleet up` creates
it with the admin credential, whose layout keeper creates a lost one again), then creates or
re-creates the durable consumer of each of its bases. The pull subscriptions stay valid across
that: a fetch names the consumer, so it works again as soon as the consumer exists under the same name.

A consumer is checked when a pull fails (a missing consumer answers a fetch with 503 at once)
and every `check_s` otherwise. `healthy(base)` says whether pulls for the base can work; the
worker only advertises (heartbeats) the bases that are healthy, so gateways' readiness is honest.
Each loss and each recovery is logged once, not at every failed pull.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from nats.js.errors import NotFoundError

from lorafleet.core.config import QueueConfig
from lorafleet.core.wire import consumer_name
from lorafleet.nats.queue import ensure_consumer, stream_exists

log = logging.getLogger(__name__)

CHECK_S = 2.0
RETRY_S = 0.5


class ConsumerKeeper:
    def __init__(self, js: Any, queue: QueueConfig, bases: list[str], check_s: float = CHECK_S) -> None:
        self.js = js
        self.queue = queue
        self.bases = list(bases)
        self.check_s = check_s
        self._healthy: dict[str, bool] = dict.fromkeys(self.bases, False)
        self._trigger = asyncio.Event()
        self.repairs = 0

    def healthy(self, base: str) -> bool:
        return self._healthy.get(base, False)

    def healthy_bases(self) -> list[str]:
        return [b for b in self.bases if self._healthy[b]]

    def pull_failed(self, base: str, exc: BaseException) -> None:
        """A pull on `base` failed: check its consumer now (from the scheduler; never raises)."""
        log.debug("pull on %s failed: %r", base, exc)
        self._trigger.set()

    async def setup(self) -> None:
        """Wait for the work stream, then create every consumer (idempotent)."""
        for base in self.bases:
            await self._repair(base, first=True)

    async def run(self) -> None:
        """Check the consumers every `check_s`, or at once after a failed pull; repair what is missing."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._trigger.wait(), self.check_s)
            self._trigger.clear()
            for base in self.bases:
                try:
                    present = await self._present(base)
                except Exception as exc:  # NATS reconnecting: try again at the next check
                    log.debug("checking consumer of %s: %r", base, exc)
                    continue
                if present:
                    if not self._healthy[base]:
                        log.info("consumer %s is back", consumer_name(base))
                    self._healthy[base] = True
                    continue
                if self._healthy[base]:
                    log.warning("consumer %s vanished (stream %s deleted or lost?); re-creating it",
                                consumer_name(base), self.queue.stream)
                self._healthy[base] = False
                await self._repair(base)

    async def _present(self, base: str) -> bool:
        try:
            await self.js.consumer_info(self.queue.stream, consumer_name(base))
        except NotFoundError:
            return False
        return True

    async def _repair(self, base: str, first: bool = False) -> None:
        """Until it works: wait for the stream, then create the consumer."""
        waiting_logged = False
        while True:
            try:
                if await stream_exists(self.js, self.queue.stream):
                    await ensure_consumer(self.js, base, self.queue)
                    if not first:
                        self.repairs += 1
                        log.info("consumer %s re-created; pulling again", consumer_name(base))
                    self._healthy[base] = True
                    return
                if not waiting_logged:
                    log.warning("waiting for stream %s (admin creates it: `lorafleet up`; workers cannot)",
                                self.queue.stream)
                    waiting_logged = True
            except Exception as exc:  # reconnecting, or the stream went away again between the two calls
                if not waiting_logged:
                    log.warning("cannot set up consumer %s yet: %r; retrying", consumer_name(base), exc)
                    waiting_logged = True
            await asyncio.sleep(RETRY_S)
