"""The engine runtimes of one worker and their lanes: started, watched and stopped on the worker's event loop.

Each base whose runtime is an `EngineRuntime` gets a lane (engine_lane.py) that starts its engine, then
pulls for it. An engine that cannot start, or does not come back after dying, stops the worker with an
error (`on_fatal`): a supervisor restarts the whole worker. What heartbeats say of the engines (bases
that serve, slots in use, KV-cache use, adapters, service rates) is read here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from lorafleet.sidecar.engine_adapters import EngineAdapters
from lorafleet.sidecar.engine_lane import EngineLane, UriFor
from lorafleet.sidecar.intake import Intake
from lorafleet.sidecar.runtime import EngineRuntime
from lorafleet.sidecar.service_rate import ServiceRate
from lorafleet.sidecar.settle import Settler
from lorafleet.sidecar.streaming import TextStreams

log = logging.getLogger(__name__)


class EngineLanes:
    def __init__(self, engines: dict[str, tuple[EngineRuntime, EngineAdapters]] | None = None,
                 uri_for: UriFor | None = None) -> None:
        self.engines = dict(engines or {})
        self.uri_for: UriFor = uri_for or (lambda adapter, uri: uri)
        self.lanes: dict[str, EngineLane] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def __contains__(self, base: object) -> bool:
        return base in self.engines

    def start(self, psubs: dict[str, Any], intake: Intake, settler: Settler, streams: TextStreams,
              stopping: Callable[[], bool], on_pull_error: Callable[[str, BaseException], None],
              on_fatal: Callable[[BaseException], None]) -> None:
        for base, (runtime, adapters) in self.engines.items():
            lane = EngineLane(base, psubs[base], runtime, adapters, intake, settler, streams, self.uri_for, stopping,
                              on_pull_error=on_pull_error, on_fatal=on_fatal)
            self.lanes[base] = lane
            self.tasks.append(asyncio.create_task(self._run(lane, on_fatal), name=f"lane-{base}"))

    @staticmethod
    async def _run(lane: EngineLane, on_fatal: Callable[[BaseException], None]) -> None:
        try:
            await lane.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine did not start: nothing of this base can be served
            log.error("engine of %s failed: %s", lane.base, exc)
            on_fatal(exc)

    def pulling(self) -> list[asyncio.Task[None]]:
        return [t for t in self.tasks if not t.done()]

    def serves(self, base: str) -> bool:
        """An engine's base counts (heartbeats) only once its engine serves."""
        return base not in self.engines or (base in self.lanes and self.lanes[base].ready)

    def service_rates(self) -> dict[str, ServiceRate]:
        return {b: lane.service_rate for b, lane in self.lanes.items()}

    async def report(self) -> tuple[dict[str, list[str]], dict[str, int], dict[str, int], dict[str, float]]:
        """(adapters, slots in use, slots, KV-cache use) per engine base, for a heartbeat."""
        adapters: dict[str, list[str]] = {}
        used: dict[str, int] = {}
        slots: dict[str, int] = {}
        kv: dict[str, float] = {}
        for base, lane in self.lanes.items():
            adapters[base] = lane.adapters.loaded()
            used[base], slots[base] = lane.in_use, lane.slots
            kv[base] = round((await lane.read_stats()).kv_cache_usage, 4)
        return adapters, used, slots, kv

    async def cancel_sequences(self) -> None:
        """At a drain timeout: every sequence stops, unsettled (the caller gives the tasks back)."""
        for lane in self.lanes.values():
            await lane.cancel_all()

    async def close(self) -> None:
        for task in self.tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for base, (runtime, _) in self.engines.items():
            try:
                await runtime.close()
            except Exception as exc:
                log.warning("stopping the engine of %s: %r", base, exc)
