"""Shadow traffic in the gateway (issue 25, part 5): copies of part of a name's requests on a candidate version.

The fleet state's `shadow` spec (`lorafleet promote NAME --shadow P`) makes every gateway mirror P % of the plain
name's requests (`agreement.mirror_now`: exactly P %, spread evenly) to the candidate. The client's answer is always
the champion's: the copy is published only after the champion has answered (it is never ahead of the request it
copies in the queue), in a background task, and its answer is only compared with the champion's (latency, length,
exact match and chrF for text, rank overlap for rerank) and discarded.

Shadow load must not delay the champion: a copy is shed (dropped, counted) before it is published whenever the
base's backlog shows a queue forming (more tasks waiting or running than live workers of the base), this gateway
already has `MAX_INFLIGHT` copies in flight for the base, or the tasks it publishes for the base take more than
`MAX_UTILIZATION` of what the workers complete per second (their heartbeats' service rate): under load the shadow
goes first and the champion's requests find the queue as they would without it. A copy a worker has started still
runs to its end (a batch runtime computes one adapter's batch at a time), so on a worker without spare capacity a
champion request that arrives meanwhile waits for it: bench/shadow.py measures what that costs the champion's p99.

The cumulative figures are published every `PUBLISH_EVERY_S` on
`lorafleet.stats.gateway.<id>.shadow` (lorafleet.core.agreement.GatewayShadowStats); `promote --finish/--abort` sums
them over all gateways and logs them to the candidate's MLflow run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lorafleet.core.agreement import (
    GatewayShadowStats,
    ShadowFigures,
    ShadowKey,
    chrf,
    exact_match,
    mirror_now,
    rank_overlap,
    shadow_subject,
)
from lorafleet.core.fleet_state import FleetEntry
from lorafleet.serve.errors import ApiError
from lorafleet.serve.resolver import Route, Specialist

if TYPE_CHECKING:
    from lorafleet.serve.completions import GenerationBody
    from lorafleet.serve.gateway import Gateway

log = logging.getLogger("lorafleet.serve")

MAX_INFLIGHT = 4  # copies in flight per base on one gateway; more are shed
MAX_UTILIZATION = 0.5  # copies only while this gateway's tasks take at most half of what the workers complete
RATE_WINDOW_S = 2.0
KEEP_ENDED_S = 600.0  # an ended shadow's figures stay published this long (a late --finish/--abort still reads them)
PUBLISH_EVERY_S = 1.0


@dataclass(frozen=True, slots=True)
class Active:
    """One name's shadow as this gateway applies it."""

    key: ShadowKey  # (name, champion, candidate, started)
    percent: float
    route: Route  # the candidate's


def active_shadows(entries: Iterable[FleetEntry], bases: Iterable[str]) -> dict[str, Active]:
    """The shadows of the fleet table whose candidate runs on a base this gateway serves."""
    known = set(bases)
    out = {}
    for e in entries:
        s = e.shadow
        if s is None or s.base not in known:
            continue
        spec = Specialist(s.system_prompt, s.chat_template, s.generation) \
            if s.system_prompt or s.chat_template or s.generation else None
        route = Route(name=e.name, base=s.base, adapter=s.adapter_id, adapter_uri=s.adapter_uri, specialist=spec,
                      version=s.version)
        out[e.name] = Active((e.name, e.version, s.version, s.started), s.percent, route)
    return out


def should_shed(backlog: int, shadow_inflight: int, live_workers: int, max_inflight: int = MAX_INFLIGHT,
                arrival_per_s: float | None = None, service_per_s: float | None = None,
                max_utilization: float = MAX_UTILIZATION) -> bool:
    """Drop a copy rather than publish it: this gateway already has `max_inflight` copies out for the base, the
    champion's side of the backlog (the base's, less this gateway's copies) exceeds one task per live worker, or
    the tasks this gateway publishes for the base (copies included) already take more than `max_utilization` of
    what its workers complete per second (a busy worker would make the next champion request wait behind a copy)."""
    if shadow_inflight >= max_inflight or backlog - shadow_inflight > max(live_workers, 1):
        return True
    return bool(arrival_per_s is not None and service_per_s and arrival_per_s > max_utilization * service_per_s)


class Rate:
    """Tasks per second from a growing counter, over the last `window_s` (pure arithmetic on given times)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def per_s(self, count: int, now: float) -> float | None:
        s = self._samples
        s.append((now, count))
        while len(s) > 2 and now - s[1][0] >= self.window_s:  # keep one sample at least a window old
            s.popleft()
        t0, c0 = s[0]
        return (count - c0) / (now - t0) if now - t0 >= self.window_s / 4 else None


class ShadowMirror:
    """Per gateway: which names are shadowed, the sampling counters, the copies in flight and the figures."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._active: dict[str, Active] = {}
        self._seen: dict[ShadowKey, int] = {}
        self.figures: dict[ShadowKey, ShadowFigures] = {}
        self._inflight: dict[str, int] = {}
        self._rates: dict[str, Rate] = {}
        self._ended: dict[ShadowKey, float] = {}  # when a shadow with figures left the fleet state
        self._tasks: set[asyncio.Task[None]] = set()
        self._publisher: asyncio.Task[None] | None = None

    def update(self, entries: Iterable[FleetEntry]) -> None:
        self._active = active_shadows(entries, self.gw.resolver.bases)
        live = {a.key for a in self._active.values()}
        now = time.monotonic()
        for key in [k for k in self.figures if k not in live]:  # an ended shadow's figures: kept a while, then gone
            if now - self._ended.setdefault(key, now) > KEEP_ENDED_S:
                self.figures.pop(key, None)
                self._seen.pop(key, None)
                self._ended.pop(key, None)

    # -- sampling ---------------------------------------------------------------------------------------------
    def _take(self, route: Route, asked: str) -> Active | None:
        """The shadow a champion answer of `route` is mirrored to now, or None (not shadowed, not sampled, shed)."""
        a = self._active.get(route.name)
        if a is None or asked != route.name or route.version != a.key[1]:  # plain-name champion answers only
            return None
        n = self._seen.get(a.key, 0)
        self._seen[a.key] = n + 1
        figures = self.figures.get(a.key, ShadowFigures())
        if not mirror_now(n, a.percent):
            self.figures[a.key] = ShadowFigures(eligible=1) + figures
            return None
        base = a.route.base
        inflight = self._inflight.get(base, 0)
        live = self.gw.workers.live_counts([base]).get(base, 0)
        rate = self._rates.setdefault(base, Rate()).per_s(self.gw.metrics.published_total.get(base, 0),
                                                          time.monotonic())
        shed = should_shed(self.gw.monitor.backlog(base), inflight, live, arrival_per_s=rate,
                           service_per_s=self.gw.workers.service_rate(base))
        self.figures[a.key] = ShadowFigures(eligible=1, mirrored=int(not shed), shed=int(shed)) + figures
        return None if shed else a

    def _spawn(self, base: str, coro: Any) -> None:
        self._inflight[base] = self._inflight.get(base, 0) + 1
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            self._inflight[base] -= 1

        task.add_done_callback(done)

    # -- generative ---------------------------------------------------------------------------------------------
    def generated(self, route: Route, body: GenerationBody, text: str, seconds: float, deadline_s: float) -> None:
        """A champion answered a (non-streamed) generation of `route`: mirror it if sampled."""
        a = self._take(route, body.model)
        if a is not None:
            self._spawn(a.route.base, self._generate(a, body, text, seconds, deadline_s))

    async def _generate(self, a: Active, body: GenerationBody, text: str, seconds: float, deadline_s: float) -> None:
        t0 = time.perf_counter()
        try:
            prepared = await self.gw.prepare(a.route, body)
            generation = await self.gw.generate(a.route, prepared, deadline_s)
            try:
                result = await generation.result()
            finally:
                generation.close()
            other = result.text or ""
        except ApiError as exc:
            if exc.status in (429, 503):
                self._refused(a.key, exc)
            else:
                self._failed(a.key)
            return
        except Exception as exc:  # the copy's failure is a figure, never the client's problem
            log.debug("shadow copy of %s failed: %r", a.key, exc)
            self._failed(a.key)
            return
        f = self.figures.get(a.key, ShadowFigures())
        self.figures[a.key] = f.compare(seconds, time.perf_counter() - t0, len(text), len(other),
                                        exact_match(text, other), chrf(other, text))

    # -- rerank ---------------------------------------------------------------------------------------------
    def reranked(self, route: Route, asked: str, query: str, documents: list[str], order: list[int],
                 seconds: float, deadline_s: float) -> None:
        """A champion answered a rerank of `route` (documents by descending score): mirror it if sampled."""
        a = self._take(route, asked)
        if a is not None:
            self._spawn(a.route.base, self._rerank(a, query, documents, order, seconds, deadline_s))

    async def _rerank(self, a: Active, query: str, documents: list[str], order: list[int], seconds: float,
                      deadline_s: float) -> None:
        from lorafleet.serve.rerank import ranked, score  # rerank imports the gateway, which imports this

        t0 = time.perf_counter()
        try:
            other = ranked((await score(self.gw, a.route, query, documents, deadline_s)).scores, None)
        except ApiError as exc:
            if exc.status in (429, 503):
                self._refused(a.key, exc)
            else:
                self._failed(a.key)
            return
        except Exception as exc:
            log.debug("shadow copy of %s failed: %r", a.key, exc)
            self._failed(a.key)
            return
        f = self.figures.get(a.key, ShadowFigures())
        self.figures[a.key] = f.compare(seconds, time.perf_counter() - t0, len(order), len(other),
                                        list(order) == list(other), overlap=rank_overlap(order, other))

    def _refused(self, key: ShadowKey, exc: ApiError) -> None:
        """Admission refused the copy (429) or its base is unavailable (503): shed, not a candidate error."""
        log.debug("shadow copy of %s shed at publishing: %s", key, exc.status)
        self.figures[key] = ShadowFigures(mirrored=-1, shed=1) + self.figures.get(key, ShadowFigures())

    def _failed(self, key: ShadowKey) -> None:
        self.figures[key] = ShadowFigures(errors=1) + self.figures.get(key, ShadowFigures())

    # -- figures over NATS --------------------------------------------------------------------------------------
    def stats(self) -> GatewayShadowStats | None:
        return GatewayShadowStats(self.gw.gateway_id, dict(self.figures)) if self.figures else None

    def start(self, nc: Any) -> None:
        if self._publisher is None or self._publisher.done():
            self._publisher = asyncio.create_task(self._publish(nc), name="lorafleet-shadow-figures")

    async def _publish(self, nc: Any) -> None:
        subject = shadow_subject(self.gw.gateway_id)
        while True:
            stats = self.stats()
            if stats is not None:
                with contextlib.suppress(Exception):  # reconnecting: the next round carries the same totals
                    await nc.publish(subject, stats.to_wire())
            await asyncio.sleep(PUBLISH_EVERY_S)

    async def stop(self) -> None:
        for task in [self._publisher, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._publisher, *self._tasks] if t is not None], return_exceptions=True)
        self._publisher = None
