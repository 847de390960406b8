"""The gateway's request core: NATS lifecycle, resolve → count tokens → publish → await results.

Request path (kept lean for throughput): resolve the served name → count tokens → check a live
worker → publish all tasks concurrently to JetStream → await one future per request, resolved by
the inbox subscription or by the deadline timer → results in input order. The HTTP side (auth,
body parsing, response shaping) is serve/routes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError

from lorafleet import heartbeats, wire
from lorafleet.config import FleetConfig
from lorafleet.fleet_state import FleetWatcher, merge_models
from lorafleet.queue import JS_ERR_STREAM_FULL, ensure_streams
from lorafleet.serve.auth import ApiKeys, load_api_keys
from lorafleet.serve.bases import load_bases
from lorafleet.serve.errors import ApiError, bad_request, worker_error
from lorafleet.serve.metrics import GatewayMetrics
from lorafleet.serve.pending import COMPLETE, DUPLICATE, FILLED, LATE, MALFORMED, TIMEOUT, PendingTable
from lorafleet.serve.resolver import Resolver, Route
from lorafleet.serve.tokens import TokenCounter
from lorafleet.serve.workers import WorkerRegistry

log = logging.getLogger("lorafleet.serve")

_PUBLISH_TIMEOUT_S = 5.0  # cap on one JetStream publish ack; the request deadline caps it further


class Gateway:
    """State of one gateway process: NATS connection, pending requests, worker liveness, metrics."""

    def __init__(self, fleet: FleetConfig, *, nats_url: str | None = None, gateway_id: str | None = None) -> None:
        self.fleet = fleet
        self.cfg = fleet.gateway
        self.nats_url = nats_url or fleet.nats_url
        self.gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        self.resolver = Resolver.from_fleet(fleet)
        self.keys = ApiKeys(load_api_keys(self.cfg.api_keys))
        self.pending = PendingTable()
        self.workers = WorkerRegistry(self.cfg.worker_liveness_s)
        self.metrics = GatewayMetrics(self.pending.tasks_in_flight)
        # Filled by start(): tokenizers are read from disk once per base, off the event loop.
        self.tokens: dict[str, TokenCounter] = {}
        self.dims: dict[str, int] = {}
        self.created = int(time.time())
        self.nc: NatsClient | None = None
        self.js: JetStreamContext | None = None
        self.stream_ready = False
        self._inbox = wire.inbox_prefix(self.gateway_id) + "."
        self._subjects = {b: wire.work_subject(b) for b in self.resolver.bases}
        self._retry_after = {"Retry-After": str(self.cfg.retry_after_s)}
        self._connector: asyncio.Task[None] | None = None
        self._stream_setup: asyncio.Task[None] | None = None
        self._fleet_watch: FleetWatcher | None = None
        self._last_nats_error = 0.0

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        bases = await asyncio.to_thread(load_bases, self.fleet)
        self.tokens = {name: info.tokens for name, info in bases.items()}
        self.dims.update({name: info.dim for name, info in bases.items() if info.dim})
        # Connect in the background: the HTTP server (healthz, readyz → 503) is up while NATS is not.
        self._connector = asyncio.create_task(self._connect(), name="lorafleet-gateway-connect")

    async def stop(self) -> None:
        if self._fleet_watch is not None:
            await self._fleet_watch.stop()
        for task in (self._connector, self._stream_setup):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        nc, self.nc, self.js = self.nc, None, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.close()

    async def _connect(self) -> None:
        try:
            await self._connect_once()
        except asyncio.CancelledError:
            raise
        except Exception:  # e.g. a malformed URL: say so loudly, the gateway stays unready (readyz 503)
            log.exception("gateway %s cannot connect to NATS at %s", self.gateway_id, self.nats_url)

    async def _connect_once(self) -> None:
        nc = await nats.connect(
            self.nats_url,
            name=f"lorafleet-gateway-{self.gateway_id}",
            max_reconnect_attempts=-1,  # reconnect forever, also on the first connect
            reconnect_time_wait=0.5,
            connect_timeout=2,
            error_cb=self._on_nats_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
        )
        js = nc.jetstream()
        await nc.subscribe(self._inbox + ">", cb=self._on_result)
        await heartbeats.subscribe(nc, self.workers.observe)
        self.nc, self.js = nc, js
        log.info("gateway %s connected to %s", self.gateway_id, self.nats_url)
        await self._watch_fleet_state(js)
        await self._ensure_streams()

    async def _watch_fleet_state(self, js: JetStreamContext) -> None:
        """Promoted bundles (`lorafleet promote`) arrive through the fleet KV bucket; routes swap live."""

        def on_change(table: dict[str, Any]) -> None:
            self.resolver.set_models(merge_models(self.fleet.models, table.values(), self.resolver.bases))
            log.info("fleet state: serving %s", ", ".join(self.resolver.served_names()))

        try:
            self._fleet_watch = FleetWatcher(js, on_change)
            await self._fleet_watch.start()
        except Exception as exc:  # the fleet file's models still work without it
            log.warning("cannot watch the fleet state bucket: %r; serving the fleet file's models only", exc)

    async def _ensure_streams(self) -> None:
        while self.js is not None:
            try:
                await ensure_streams(self.js, self.fleet.queue)
                self.stream_ready = True
                return
            except Exception as exc:  # JetStream off, server restarting, …: keep trying, readyz says so
                self.stream_ready = False
                log.warning("cannot set up stream %s yet: %r; retrying", self.fleet.queue.stream, exc)
                await asyncio.sleep(1.0)

    async def _on_nats_error(self, exc: Exception) -> None:
        # nats-py reports every failed reconnect attempt; log at most one line per 10 s.
        now = time.monotonic()
        if now - self._last_nats_error > 10.0:
            self._last_nats_error = now
            log.warning("NATS %s: %r", self.nats_url, exc)

    async def _on_disconnected(self) -> None:
        log.warning("gateway %s disconnected from NATS", self.gateway_id)

    async def _on_reconnected(self) -> None:
        log.info("gateway %s reconnected to NATS", self.gateway_id)
        # A restarted server with a memory store has lost the stream; recreate it.
        if self._stream_setup is None or self._stream_setup.done():
            self._stream_setup = asyncio.get_running_loop().create_task(self._ensure_streams())

    # ---- NATS callbacks ----------------------------------------------------------------------

    async def _on_result(self, msg: Msg) -> None:
        request_id = msg.subject[len(self._inbox):]
        if msg.reply:
            # Confirm receipt: a worker acks its task only once a gateway has the result, so a
            # result sent while this gateway was reconnecting is redelivered instead of lost.
            await self.nc.publish(msg.reply, b"")
        try:
            result = wire.Result.from_wire(msg.data)
        except Exception:  # a stray message on our inbox must not kill the subscription
            self.metrics.dropped_results.labels("malformed").inc()
            return
        problem = result.check()
        if problem is not None:
            # Never answer a client with a vector of the wrong size: fail the request instead.
            result.error_code, result.error_message = wire.ERR_MALFORMED, problem
        pending = self.pending.get(request_id)
        outcome = self.pending.deliver(request_id, result)
        if outcome is FILLED or outcome is COMPLETE:
            assert pending is not None
            self.metrics.result_received(pending.base, result.queue_ms, result.batch_size)
            if result.dim and pending.base not in self.dims:
                self.dims[pending.base] = result.dim
        elif outcome is LATE or outcome is DUPLICATE or outcome is MALFORMED:
            self.metrics.dropped_results.labels(outcome).inc()

    # ---- request path ------------------------------------------------------------------------

    def resolve(self, name: str) -> Route:
        route = self.resolver.resolve(name)
        if route is None:
            names = ", ".join(self.resolver.served_names())
            raise ApiError(404, "model_not_found", f"model {name!r} is not served here; served models: {names}")
        return route

    def _count_tokens(self, route: Route, inputs: list[str]) -> list[int]:
        counts = self.tokens[route.base].count(inputs)
        limit = self.cfg.max_input_tokens
        for i, n in enumerate(counts):
            if n > limit:
                raise bad_request(
                    "input_too_long",
                    f"input {i} has {n} tokens; the limit is max_input_tokens={limit} for model {route.name!r}: "
                    "shorten or split it",
                )
        return counts

    def _check_available(self, base: str) -> JetStreamContext:
        nc, js = self.nc, self.js
        if nc is None or js is None or not nc.is_connected:
            raise ApiError(503, "queue_unavailable", "the gateway is not connected to NATS; retry shortly",
                           self._retry_after)
        if not self.workers.serves(base):
            raise ApiError(
                503, "no_worker",
                f"no live worker serves base model {base!r} (no heartbeat within "
                f"worker_liveness_s={self.cfg.worker_liveness_s:g}s); start a worker for it or retry shortly",
                self._retry_after,
            )
        return js

    async def embed(self, route: Route, inputs: list[str], deadline_s: float) -> tuple[list[wire.Result], int]:
        """Publish one task per input and return the results in input order plus the prompt tokens."""
        counts = self._count_tokens(route, inputs)
        js = self._check_available(route.base)
        n = len(inputs)
        request_id = uuid.uuid4().hex
        now = time.time()
        reply = self._inbox + request_id
        subject = self._subjects[route.base]
        ids = [f"{request_id}.{i}" for i in range(n)]
        payloads = [
            wire.Task(id=ids[i], request_id=request_id, index=i, model=route.name, base=route.base, text=text,
                      tokens=counts[i], deadline=now + deadline_s, reply=reply, adapter=route.adapter,
                      adapter_uri=route.adapter_uri, enqueued=now).to_wire()
            for i, text in enumerate(inputs)
        ]
        pending = self.pending.add(request_id, route.base, n, deadline_s)  # before publishing: replies may be fast
        try:
            timeout = max(min(deadline_s, _PUBLISH_TIMEOUT_S), 0.001)
            if n == 1:  # the common case: skip gather's extra task
                try:
                    await js.publish(subject, payloads[0], timeout=timeout, headers={wire.HDR_MSG_ID: ids[0]})
                except Exception as exc:
                    raise self._publish_error(exc, deadline_s) from exc
            else:
                # All publishes in flight at once: one awaited publish after another is ~5x slower.
                outcomes = await asyncio.gather(
                    *[js.publish(subject, p, timeout=timeout, headers={wire.HDR_MSG_ID: ids[i]})
                      for i, p in enumerate(payloads)],
                    return_exceptions=True,
                )
                for out in outcomes:
                    if isinstance(out, BaseException):
                        raise self._publish_error(out, deadline_s) from out
            self.metrics.published(route.base, n)
            value = await pending.future
        finally:
            self.pending.discard(request_id)
        if value is None:
            return pending.results, sum(counts)  # type: ignore[return-value]  # all slots filled
        if value is TIMEOUT:
            raise ApiError(
                504, "deadline_exceeded",
                f"the deadline of {deadline_s * 1000:.0f} ms passed with {pending.filled} of {n} inputs embedded; "
                "send a longer X-Lorafleet-Deadline-Ms (or deadline_ms) or retry when the queue is shorter",
            )
        assert isinstance(value, wire.Result) and value.error_code is not None
        raise worker_error(value.error_code, value.error_message, value.index, self.cfg.retry_after_s)

    def _publish_error(self, exc: BaseException, deadline_s: float) -> ApiError:
        if isinstance(exc, APIError) and exc.err_code in JS_ERR_STREAM_FULL:
            return ApiError(429, "queue_full", f"the work queue is full ({exc.description}); retry later",
                            self._retry_after)
        if isinstance(exc, NoStreamResponseError):
            return ApiError(503, "queue_unavailable",
                            f"the work stream {self.fleet.queue.stream} does not answer; retry shortly",
                            self._retry_after)
        if isinstance(exc, asyncio.TimeoutError | NatsTimeoutError):
            return ApiError(503, "queue_unavailable", "the work stream did not acknowledge in time; retry shortly",
                            self._retry_after)
        log.warning("publish failed: %r", exc)
        return ApiError(503, "queue_unavailable", f"publishing to the work queue failed ({exc!r}); retry shortly",
                        self._retry_after)

    def check_dimensions(self, route: Route, dimensions: int | None) -> None:
        if dimensions is None:
            return
        native = self.dims.get(route.base)
        if native != dimensions:
            what = f"{native}-dimensional vectors; omit 'dimensions' or pass {native}" if native else (
                "vectors of its native size only; omit 'dimensions'")
            raise bad_request("unsupported_dimensions", f"model {route.name!r} returns {what}")

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, detail) for /readyz: connected, the work stream answers, live workers per base."""
        nc, js = self.nc, self.js
        connected = nc is not None and nc.is_connected
        stream = False
        if connected and js is not None:
            try:
                await asyncio.wait_for(js.stream_info(self.fleet.queue.stream), 2.0)
                stream = True
            except Exception:
                stream = False
        self.stream_ready = stream
        ready = connected and stream
        return ready, {
            "ready": ready,
            "gateway_id": self.gateway_id,
            "nats": {"url": self.nats_url, "connected": connected},
            "stream": {"name": self.fleet.queue.stream, "exists": stream},
            "workers": self.workers.live_counts(self.resolver.bases),
        }
