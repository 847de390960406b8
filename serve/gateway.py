"""The gateway's request core: NATS lifecycle, resolve → count tokens → admit → publish → await results.

A generative request is one task (`generate`: its prompt rendered and counted by generation.py), awaited
whole or read as a stream (textstream.py); receipts tell its worker when nobody waits any more.

Request path (kept lean for throughput): resolve the served name → count tokens (in a thread for
large inputs, so the event loop never stalls) → check the base is served (connected, its consumer
exists, a live worker) → admission control (admission.py: refuse with 429 what cannot finish
within the deadline) → publish all tasks concurrently to JetStream → await one future per request,
resolved by the inbox subscription or by the deadline timer → results in input order. The HTTP
side (auth, body parsing, response shaping) is serve/routes.py; the queue's state comes from
queue_monitor.py, which also re-creates a lost stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck

from lorafleet.core import heartbeats, wire
from lorafleet.core.config import FleetConfig
from lorafleet.core.fleet_state import FleetEntry, FleetWatcher, merge_models
from lorafleet.nats.auth import explain_connect_error, gateway_inbox_prefix
from lorafleet.nats.client import RECONNECT_OPTIONS, ClientSettings, server_urls
from lorafleet.nats.queue import ensure_fleet_streams, stream_exists
from lorafleet.serve.admission import fits, judge
from lorafleet.serve.auth import ApiKeys, load_api_keys
from lorafleet.serve.bases import BaseInfo, load_bases
from lorafleet.serve.completions import ROUTE_OF, GenerationBody
from lorafleet.serve.errors import ApiError, bad_request, clip, worker_error
from lorafleet.serve.generation import Generation, Prepared, prepare
from lorafleet.serve.metrics import GatewayMetrics
from lorafleet.serve.pending import COMPLETE, DUPLICATE, FILLED, LATE, MALFORMED, TIMEOUT, PendingTable
from lorafleet.serve.publish import deadline_error, publish_error, publish_task, take_back
from lorafleet.serve.queue_monitor import QueueMonitor
from lorafleet.serve.resolver import ROUTE_KEY_HEADER, Resolver, Route, Specialist, route_key
from lorafleet.serve.shadow import ShadowMirror
from lorafleet.serve.textstream import TextStream
from lorafleet.serve.tokens import TokenCounter
from lorafleet.serve.workers import WorkerRegistry

log = logging.getLogger("lorafleet.serve")

T = TypeVar("T")

_INLINE_TOKENS_CHARS = 32_768  # inputs longer than this in total are counted in a thread, off the event loop


class Gateway:
    """State of one gateway process: NATS connection, pending requests, worker liveness, metrics."""

    def __init__(self, fleet: FleetConfig, *, nats_url: str | None = None, gateway_id: str | None = None,
                 client: ClientSettings | None = None) -> None:
        self.fleet = fleet
        self.cfg = fleet.gateway
        self.nats_url = nats_url or fleet.nats_url
        self.gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        # Credential and TLS: given, else from the environment and the fleet file (nats_client.ClientSettings).
        self.client = client if client is not None else ClientSettings.resolve(config=fleet.nats)
        self.resolver = Resolver.from_fleet(fleet)
        self.keys = ApiKeys(load_api_keys(self.cfg.api_keys))
        self.pending = PendingTable()
        self.workers = WorkerRegistry(self.cfg.worker_liveness_s)
        self.metrics = GatewayMetrics(self.pending.tasks_in_flight)
        # Filled by start(): tokenizers are read from disk once per base, off the event loop.
        self.bases: dict[str, BaseInfo] = {}
        self.tokens: dict[str, TokenCounter] = {}
        self.dims: dict[str, int] = {}
        self.streams: dict[str, TextStream] = {}  # request id → the text stream of a streaming generation
        self.created = int(time.time())
        self.nc: NatsClient | None = None
        self.js: JetStreamContext | None = None
        # Streams are admin's (docs/security.md): with a credential this gateway waits for them; without one the
        # server is open to every client, and it creates what is missing itself.
        self.monitor = QueueMonitor(fleet, self.resolver.bases, self.pending.outstanding, self._rewatch_fleet_state,
                                    create_missing=self.client.creds is None)
        self.metrics.watch_queue(self.resolver.bases, self.monitor.backlog, self.workers.service_rate)
        self.metrics.watch_lag(self.resolver.bases, self.monitor.lag)
        self.shadow = ShadowMirror(self)  # copies of a shadowed name's requests to its candidate (issue 25)
        self._beacon: heartbeats.Beacon | None = None  # presence, for `lorafleet status` from any host
        # Results arrive on `_INBOX.<credential's public key>.<gateway id>.<request id>`: only this credential
        # may subscribe there (docs/security.md).
        self._inbox = gateway_inbox_prefix(self.gateway_id, self.client.creds) + "."
        self._subjects = {b: wire.work_subject(b) for b in self.resolver.bases}
        # Bases whose workers an autoscaler starts from the queue lag: their tasks may wait for a first worker.
        self._scale_to_zero = {b.name for b in fleet.bases if b.scale_to_zero}
        self._retry_after = {"Retry-After": str(self.cfg.retry_after_s)}
        self._connector: asyncio.Task[None] | None = None
        self._fleet_watch: FleetWatcher | None = None
        self._token_pool: ThreadPoolExecutor | None = None
        self._last_nats_error = 0.0

    @property
    def inbox_prefix(self) -> str:
        """Where this gateway's results arrive (a task's reply is this plus `.<request id>`)."""
        return self._inbox[:-1]

    @property
    def stream_ready(self) -> bool:
        return self.monitor.stream_exists

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        bases = await asyncio.to_thread(load_bases, self.fleet)
        self.bases = bases
        self.tokens = {name: info.tokens for name, info in bases.items() if info.tokens is not None}
        self.dims.update({name: info.dim for name, info in bases.items() if info.dim})
        # Connect in the background: the HTTP server (healthz, readyz → 503) is up while NATS is not.
        self._connector = asyncio.create_task(self._connect(), name="lorafleet-gateway-connect")

    async def stop(self) -> None:
        await self.monitor.stop()
        await self.shadow.stop()
        if self._beacon is not None:
            await self._beacon.stop()
        if self._fleet_watch is not None:
            await self._fleet_watch.stop()
        if self._token_pool is not None:
            self._token_pool.shutdown(wait=False, cancel_futures=True)
        task = self._connector
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
        except Exception as exc:  # e.g. refused credentials: say so loudly, the gateway stays unready (readyz 503)
            log.error("gateway %s cannot connect: %s", self.gateway_id, explain_connect_error(exc, self.nats_url))

    async def _connect_once(self) -> None:
        nc = await nats.connect(
            server_urls(self.nats_url),  # one server, or a cluster's: fail over among them
            name=f"lorafleet-gateway-{self.gateway_id}",
            **RECONNECT_OPTIONS,  # reconnect forever, also on the first connect
            connect_timeout=2,
            error_cb=self._on_nats_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
            **self.client.options(),
        )
        js = nc.jetstream()
        await nc.subscribe(self._inbox + ">", cb=self._on_result)
        await heartbeats.subscribe(nc, self._on_heartbeat)
        self.nc, self.js = nc, js
        log.info("gateway %s connected to %s", self.gateway_id, self.nats_url)
        await self._ensure_streams()  # before the fleet watch: a brand-new server has neither yet
        await self._watch_fleet_state(js)
        self.monitor.start(js)
        self._beacon = heartbeats.Beacon(nc, "gateway", self.gateway_id, self._presence_state,
                                         stats=lambda: self.metrics.version_stats(self.gateway_id))
        self._beacon.start()
        self.shadow.start(nc)

    async def _presence_state(self) -> str:
        return "ready" if (await self.readiness())[0] else "not-ready"

    async def _rewatch_fleet_state(self) -> None:
        """The streams were lost (a memory store restarted): the fleet bucket may be gone with them."""
        if self._fleet_watch is not None:
            await self._fleet_watch.stop()
            self._fleet_watch = None
        if self.js is not None:
            await self._watch_fleet_state(self.js)  # admin's keeper makes the bucket before the streams

    async def _watch_fleet_state(self, js: JetStreamContext) -> None:
        """Promoted bundles (`lorafleet promote`) arrive through the fleet KV bucket; routes swap live."""

        def on_change(table: dict[str, Any]) -> None:
            self.resolver.set_models(merge_models(self.fleet.models, table.values(), self.resolver.bases),
                                     specialists(table.values()), table.values())
            self.shadow.update(table.values())
            log.info("fleet state: serving %s", ", ".join(self.resolver.served_names()))

        try:
            self._fleet_watch = FleetWatcher(js, on_change, replicas=self.fleet.nats.stream_replicas())
            await self._fleet_watch.start()
        except Exception as exc:  # the fleet file's models still work without it
            log.warning("cannot watch the fleet state bucket: %r; serving the fleet file's models only", exc)

    async def _ensure_streams(self) -> None:
        """Until the streams exist: created by admin (`lorafleet up`, its layout keeper), or here without auth."""
        waiting_logged = False
        while self.js is not None:
            try:
                if self.monitor.create_missing:
                    await ensure_fleet_streams(self.js, self.fleet, update=False)
                elif not await stream_exists(self.js, self.fleet.queue.stream):
                    if not waiting_logged:
                        log.warning("waiting for stream %s (the admin credential creates it: `lorafleet up`, or "
                                    "`lorafleet layout` next to this gateway)", self.fleet.queue.stream)
                        waiting_logged = True
                    await asyncio.sleep(0.5)
                    continue
                self.monitor.stream_exists = True
                return
            except Exception as exc:  # JetStream off, server restarting, …: keep trying, readyz says so
                log.warning("cannot set up stream %s yet: %r; retrying", self.fleet.queue.stream, exc)
                await asyncio.sleep(1.0)

    async def _on_nats_error(self, exc: Exception) -> None:
        # nats-py reports every failed reconnect attempt; log at most one line per 10 s.
        now = time.monotonic()
        if now - self._last_nats_error > 10.0:
            self._last_nats_error = now
            log.warning("NATS: %s", explain_connect_error(exc, self.nats_url))

    async def _on_disconnected(self) -> None:
        log.warning("gateway %s disconnected from NATS", self.gateway_id)

    async def _on_reconnected(self) -> None:
        log.info("gateway %s reconnected to NATS", self.gateway_id)
        self.monitor.trigger()  # a restarted server with a memory store has lost the stream: re-create it now

    # ---- NATS callbacks ----------------------------------------------------------------------

    def _on_heartbeat(self, hb: wire.Heartbeat) -> None:
        self.workers.observe(hb)
        # A worker lists a base only while its consumer exists: if the last read missed it, read again now.
        if any(b in self.monitor.queues and not self.monitor.consumer_present(b) for b in hb.bases):
            self.monitor.trigger()

    async def _on_result(self, msg: Msg) -> None:
        request_id = msg.subject[len(self._inbox):]
        if msg.reply:
            # Confirm receipt: a worker acks its task only once a gateway has the result, so a
            # result sent while this gateway was reconnecting is redelivered instead of lost. The body says
            # whether anyone still waits for the request: a generating worker stops when nobody does.
            await self.nc.publish(msg.reply, b"" if request_id in self.pending else wire.RECEIPT_CANCEL)
        if not msg.data:
            return  # a worker's probe (sidecar/owners.py, streaming.py): is this task's gateway still here?
        try:
            result = wire.Result.from_wire(msg.data)
        except Exception:  # a stray message on our inbox must not kill the subscription
            self.metrics.dropped_results.labels("malformed").inc()
            return
        problem = result.check()
        if problem is not None:
            # Never answer a client with a vector of the wrong size: fail the request instead.
            result.error_code, result.error_message = wire.ERR_MALFORMED, problem
        stream = self.streams.get(request_id)
        if result.is_chunk:
            if stream is not None:
                stream.chunk(result)
            return
        if stream is not None and result.ok:
            stream.final(result)
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

    def route_key(self, request: Any) -> str | None:
        """The client's route key for a canary's sticky split (issue 25): the X-Lorafleet-Route-Key header, else
        the API key's id (a digest, never the key), else a digest of the client address. None while no name is
        under a canary (nothing to compute on the request path)."""
        if not self.resolver.has_splits:
            return None
        return route_key(request.headers.get(ROUTE_KEY_HEADER), request.headers.get("authorization"),
                         request.client.host if request.client is not None else None)

    def resolve(self, name: str, key: str | None = None) -> Route:
        """`key`: the client's route key (a canary's sticky split, issue 25); NAME@N: 400/404/410."""
        route = self.resolver.resolve(name, key) or self.resolver.resolve_pinned(name)
        if route is None:
            names = ", ".join(self.resolver.served_names())
            raise ApiError(404, "model_not_found", f"model {clip(name)!r} is not served here; served models: {names}")
        return route

    async def _count_tokens(self, route: Route, inputs: list[str]) -> list[int]:
        counter = self.tokens[route.base]
        if sum(len(t) for t in inputs) <= _INLINE_TOKENS_CHARS:
            counts = counter.count(inputs)
        else:
            counts = await self._in_token_thread(counter.count_in_thread, inputs)
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
        # While the client reconnects (its node was lost) publishes are buffered and publish_task retries
        # through the failover: only a connection that is gone or not yet made answers 503 here.
        if nc is None or js is None or not (nc.is_connected or nc.is_reconnecting):
            raise ApiError(503, "queue_unavailable", "the gateway is not connected to NATS; retry shortly",
                           self._retry_after)
        if not self.workers.serves(base) and base not in self._scale_to_zero:
            raise ApiError(
                503, "no_worker",
                f"no live worker serves base model {base!r} (no heartbeat within "
                f"worker_liveness_s={self.cfg.worker_liveness_s:g}s); start a worker for it or retry shortly",
                self._retry_after,
            )
        return js

    async def embed(self, route: Route, inputs: list[str], deadline_s: float) -> tuple[list[wire.Result], int]:
        """Publish one task per input and return the results in input order plus the prompt tokens."""
        counts = await self._count_tokens(route, inputs)
        return await self.run_tasks(route, inputs, counts, deadline_s), sum(counts)

    async def run_tasks(self, route: Route, texts: list[str], counts: list[int], deadline_s: float,
                        op: str = wire.EMBED, params: list[dict[str, Any]] | None = None) -> list[wire.Result]:
        """Publish one task per text (of capability `op`, with its `params`) and return the results in order:
        admitted whole or refused (429), answered in full or failed explicitly (504 past the deadline, the
        first worker error otherwise)."""
        js = self._check_available(route.base)
        n = len(texts)
        self._admit(route.base, n, deadline_s)
        self._admit_room(route.base, n)
        request_id = uuid.uuid4().hex
        now = time.time()
        reply = self._inbox + request_id
        subject = self._subjects[route.base]
        ids = [f"{request_id}.{i}" for i in range(n)]
        payloads = [
            wire.Task(id=ids[i], request_id=request_id, index=i, model=route.name, base=route.base, text=text,
                      tokens=counts[i], deadline=now + deadline_s, reply=reply, adapter=route.adapter,
                      adapter_uri=route.adapter_uri, enqueued=now, op=op,
                      params=params[i] if params is not None else None).to_wire()
            for i, text in enumerate(texts)
        ]
        pending = self.pending.add(request_id, route.base, n, deadline_s)  # before publishing: replies may be fast
        try:
            if n == 1:  # the common case: skip gather's extra task
                try:
                    await self._publish(js, subject, payloads[0], ids[0], pending, deadline_s)
                except Exception as exc:
                    raise self._publish_error(exc, deadline_s, pending) from exc
            else:
                # All publishes in flight at once: one awaited publish after another is ~5x slower.
                outcomes = await asyncio.gather(
                    *[self._publish(js, subject, p, ids[i], pending, deadline_s) for i, p in enumerate(payloads)],
                    return_exceptions=True,
                )
                failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
                if failed is not None:
                    # The request fails whole: what went in would be computed for nobody, so take it back.
                    await take_back(js, [o for o in outcomes if isinstance(o, PubAck)])
                    raise self._publish_error(failed, deadline_s, pending) from failed
            self.metrics.published(route.base, n)
            value = await pending.future
        finally:
            self.pending.discard(request_id)
        if value is None:
            return pending.results  # type: ignore[return-value]  # all slots filled
        if value is TIMEOUT:
            raise deadline_error(deadline_s, pending.filled, n)
        assert isinstance(value, wire.Result) and value.error_code is not None
        raise worker_error(value, request_id, self.cfg.retry_after_s)

    def require(self, route: Route, capability: str) -> BaseInfo:
        """400 naming the right route when the model does not do what this route asks."""
        info = self.bases[route.base]
        if info.capability != capability:
            if info.capability == wire.SCORE:
                raise bad_request("wrong_route", f"model {route.name!r} is a reranker (it scores query-document "
                                  "pairs); use POST /v1/rerank")
            if info.capability == wire.GENERATE:
                raise bad_request("wrong_route", f"model {route.name!r} generates text; use POST "
                                  f"{ROUTE_OF['chat']} or POST {ROUTE_OF['completion']}")
            raise bad_request("wrong_route", f"model {route.name!r} embeds text; use POST /v1/embeddings (or POST "
                              "/v1/encode/{model})")
        return info

    async def prepare(self, route: Route, body: GenerationBody) -> Prepared:
        """Render, count and check the prompt (in a thread when it is large: never stall the event loop)."""
        prompts = self.require(route, wire.GENERATE).prompts
        assert prompts is not None
        size = len(body.prompt or "") + sum(len(m["content"]) for m in body.messages or ())
        if size <= _INLINE_TOKENS_CHARS:
            return prepare(body, route, prompts)
        return await self._in_token_thread(prepare, body, route, prompts)

    async def _in_token_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Megabytes of text take a second to tokenize: in one thread, never on the event loop (healthz and
        other requests go on meanwhile)."""
        if self._token_pool is None:
            self._token_pool = ThreadPoolExecutor(1, thread_name_prefix="lorafleet-tokens")
        return await asyncio.get_running_loop().run_in_executor(self._token_pool, fn, *args)

    async def generate(self, route: Route, prepared: Prepared, deadline_s: float) -> Generation:
        """Publish one generate task; the handle awaits its result (or streams its text)."""
        js = self._check_available(route.base)
        self._admit(route.base, 1, deadline_s)
        request_id = uuid.uuid4().hex
        now = time.time()
        task_id = f"{request_id}.0"
        payload = wire.Task(id=task_id, request_id=request_id, index=0, model=route.name, base=route.base,
                            text=prepared.prompt, tokens=prepared.prompt_tokens, deadline=now + deadline_s,
                            reply=self._inbox + request_id, adapter=route.adapter, adapter_uri=route.adapter_uri,
                            enqueued=now, op=wire.GENERATE, params=prepared.params.to_params()).to_wire()
        pending = self.pending.add(request_id, route.base, 1, deadline_s)
        stream = None
        if prepared.params.stream:
            stream = self.streams[request_id] = TextStream()
        generation = Generation(self, request_id, pending, deadline_s, stream)
        try:
            await self._publish(js, self._subjects[route.base], payload, task_id, pending, deadline_s)
        except Exception as exc:
            error = self._publish_error(exc, deadline_s, pending)
            generation.close()
            raise error from exc
        self.metrics.published(route.base, 1)
        return generation

    def _admit(self, base: str, n: int, deadline_s: float) -> None:
        """429 when the backlog ahead, at the workers' measured rate, leaves no room within the deadline."""
        refusal = judge(self.monitor.backlog(base), n, self.workers.service_rate(base), deadline_s,
                        self.cfg.admit_fraction, self.cfg.retry_after_s)
        if refusal is not None:
            self.metrics.refused(base)
            raise ApiError(429, "overloaded", refusal.message(base, n), {"Retry-After": str(refusal.retry_after_s)})

    def _admit_room(self, base: str, n: int) -> None:
        """A request of several tasks goes in whole or not at all: 429 before publishing any of it when its base's
        subject (bounded by queue.max_msgs) has no room for all of them. The backlog is the last read's plus this
        gateway's own tasks since; what it cannot see (other gateways since the read) the stream refuses, and
        `take_back` removes the part that went in."""
        limit = self.fleet.queue.max_msgs
        backlog = self.monitor.backlog(base)
        if n > 1 and not fits(backlog, n, limit):
            self.metrics.refused(base)
            raise ApiError(429, "queue_full", f"the work queue of base model {base!r} has room for "
                           f"{max(limit - backlog, 0)} more tasks, not for this request's {n} "
                           f"(queue.max_msgs={limit}); retry later or send fewer inputs", self._retry_after)

    def _publish(self, js: JetStreamContext, subject: str, payload: bytes, task_id: str, pending: Any,
                 deadline_s: float) -> Any:
        return publish_task(js, subject, payload, task_id, pending, deadline_s, self.monitor.trigger)

    def _publish_error(self, exc: BaseException, deadline_s: float, pending: Any) -> ApiError:
        return publish_error(exc, deadline_s, pending, self.fleet.queue.stream, self._retry_after,
                             self.monitor.trigger)

    def check_dimensions(self, route: Route, dimensions: int | None) -> None:
        if dimensions is None:
            return
        native = self.dims.get(route.base)
        if native != dimensions:
            what = f"{native}-dimensional vectors; omit 'dimensions' or pass {native}" if native else (
                "vectors of its native size only; omit 'dimensions'")
            raise bad_request("unsupported_dimensions", f"model {route.name!r} returns {what}")

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, detail) for /readyz: a request for every base can be served end to end now — connected,
        the stream and each base's consumer exist, a live worker pulls for it. Nothing secret in it."""
        nc = self.nc
        connected = nc is not None and nc.is_connected
        live = self.workers.live_counts(self.resolver.bases)
        bases: dict[str, Any] = {}
        for base in self.resolver.bases:
            queue = self.monitor.queues[base]
            consumer = connected and self.monitor.read_ok and self.monitor.consumer_present(base)
            cold = base in self._scale_to_zero and live[base] == 0  # its tasks wait in the stream for a worker
            bases[base] = {"consumer": consumer, "workers": live[base], "pulling": queue.pulling,
                           "scale_to_zero": base in self._scale_to_zero,
                           "ready": cold or (consumer and live[base] > 0 and queue.pulling)}
        ready = connected and self.monitor.stream_exists and all(b["ready"] for b in bases.values())
        return ready, {
            "ready": ready,
            "gateway_id": self.gateway_id,
            "nats": {"connected": connected},
            "stream": {"name": self.fleet.queue.stream, "exists": self.monitor.stream_exists},
            "workers": live,
            "bases": bases,
        }


def specialists(entries: Any) -> dict[str, Specialist]:
    """What generative bundles add to their served names (system prompt, chat template, defaults)."""
    out: dict[str, Specialist] = {}
    for e in entries:
        assert isinstance(e, FleetEntry)
        if e.system_prompt or e.chat_template or e.generation:
            out[e.name] = Specialist(e.system_prompt, e.chat_template, e.generation)
    return out
