"""The gateway's HTTP side: routes, auth, body limits, request parsing and response shaping.

Handlers parse and check the request (serve/parsing.py, serve/completions.py), hand it to the
request core (serve/gateway.py) and shape its answer; every error is the JSON `{"error": {"code",
"message"}}` with the right status, and every request is counted by route, model and status.

Generative routes answer with one JSON body or, with `stream: true`, with server-sent events: the
role, text deltas as they arrive, the finish reason, usage (with `stream_options.include_usage`),
`data: [DONE]`; an error after the first event is an explicit `data: {"error": …}` event (a code and the
request's id, as in an error body: never a worker's text; serve/errors.py). A client
that disconnects (streaming or not) makes the gateway forget the request, and the worker stops
generating at its next check-in.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as HttpRoute

from lorafleet.core import wire
from lorafleet.core.config import FleetConfig
from lorafleet.nats.client import ClientSettings
from lorafleet.serve.completions import CHAT, COMPLETION, DONE, Shaper, error_event, parse_generation
from lorafleet.serve.errors import REQUEST_ID_HEADER, ApiError, bad_request, error_response, internal_error
from lorafleet.serve.gateway import Gateway
from lorafleet.serve.generation import Generation
from lorafleet.serve.metrics import CONTENT_TYPE
from lorafleet.serve.parsing import deadline_seconds, parse_embeddings, parse_encode
from lorafleet.serve.rerank import RerankRoutes
from lorafleet.serve.routekeys import routed_by

log = logging.getLogger("lorafleet.serve")

DEADLINE_HEADER = "x-lorafleet-deadline-ms"
MSGPACK = "application/msgpack"
_STREAM_ERROR_STATUS = {"deadline_exceeded": 504, "invalid_request": 400}  # what an error event counts as


class Routes:
    """The HTTP handlers of one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def embeddings(self, request: Request) -> Response:
        t0 = time.perf_counter()
        model, version, tokens = "_invalid", None, 0  # bounded label cardinality: only served names or this
        keyed: dict[str, str] = {}  # which route key a canary's split used (issue 38)
        try:
            self.gw.keys.check(request.headers.get("authorization"))
            req = parse_embeddings(await read_body(request, self.gw.cfg.max_body_bytes), self.gw.cfg.max_inputs)
            key = self.gw.route_key(request)
            route = self.gw.resolve(req.model, key)  # a canary's sticky split (issue 25)
            keyed = self._keyed(req.model, key)
            model, version = route.name, route.version
            self.gw.require(route, wire.EMBED)
            self.gw.check_dimensions(route, req.dimensions)
            deadline_s = deadline_seconds(request.headers.get(DEADLINE_HEADER), None,
                                          self.gw.cfg.default_deadline_s, self.gw.cfg.max_deadline_s)
            results, tokens = await self.gw.embed(route, req.inputs, deadline_s)
            self.gw.check_dimensions(route, req.dimensions)  # native size may only be known from the results
            if req.encoding_format == "base64":
                data: list[dict[str, Any]] = [
                    {"object": "embedding", "index": i, "embedding": base64.b64encode(r.vector or b"").decode()}
                    for i, r in enumerate(results)
                ]
            else:
                data = [{"object": "embedding", "index": i, "embedding": r.array()} for i, r in enumerate(results)]
            body = orjson.dumps(
                {"object": "list", "data": data, "model": route.model,
                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                option=orjson.OPT_SERIALIZE_NUMPY,
            )
            response = Response(body, media_type="application/json")
        except ApiError as exc:
            response = exc.response()
        except Exception:  # a bug, not the client's fault: the JSON error shape, a request id, counted
            response = internal_error(log, request.url.path)
        response.headers.update(keyed)
        self._observe("embeddings", model, response.status_code, t0, version, tokens)
        return response

    async def encode(self, request: Request) -> Response:
        t0 = time.perf_counter()
        model, version, tokens = "_invalid", None, 0
        keyed: dict[str, str] = {}
        try:
            self.gw.keys.check(request.headers.get("authorization"))
            key = self.gw.route_key(request)
            route = self.gw.resolve(request.path_params["model"], key)
            keyed = self._keyed(request.path_params["model"], key)
            model, version = route.name, route.version
            self.gw.require(route, wire.EMBED)
            req = parse_encode(await read_body(request, self.gw.cfg.max_body_bytes), self.gw.cfg.max_inputs)
            deadline_s = deadline_seconds(request.headers.get(DEADLINE_HEADER), req.deadline_ms,
                                          self.gw.cfg.default_deadline_s, self.gw.cfg.max_deadline_s)
            results, tokens = await self.gw.embed(route, req.inputs, deadline_s)
            body = wire.encode_response(route.model, [r.vector or b"" for r in results], results[0].dim, tokens)
            response = Response(body, media_type=MSGPACK)
        except ApiError as exc:
            response = exc.response()
        except Exception:  # a bug, not the client's fault: the JSON error shape, a request id, counted
            response = internal_error(log, request.url.path)
        response.headers.update(keyed)
        self._observe("encode", model, response.status_code, t0, version, tokens)
        return response

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETION)

    async def _generate(self, request: Request, kind: str) -> Response:
        t0 = time.perf_counter()
        name = "chat" if kind == CHAT else "completions"
        model, version, tokens, empty = "_invalid", None, 0, False
        keyed: dict[str, str] = {}
        try:
            self.gw.keys.check(request.headers.get("authorization"))
            body = parse_generation(await read_body(request, self.gw.cfg.max_body_bytes), kind)  # type: ignore[arg-type]
            key = self.gw.route_key(request)
            route = self.gw.resolve(body.model, key)
            keyed = self._keyed(body.model, key)
            model, version = route.name, route.version
            deadline_s = deadline_seconds(request.headers.get(DEADLINE_HEADER), None,
                                          self.gw.cfg.default_deadline_s, self.gw.cfg.max_deadline_s)
            prepared = await self.gw.prepare(route, body)
            generation = await self.gw.generate(route, prepared, deadline_s)
            shaper = Shaper(body.kind, route.model, generation.request_id)  # the exact version: NAME@N
            ids = {REQUEST_ID_HEADER: generation.request_id, **keyed}  # the id its task, logs and errors carry
            if body.stream:  # counted when the stream ends
                return StreamingResponse(self._events(generation, shaper, body.include_usage, model, t0, version),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache", **ids})
            try:
                result = await _unless_disconnected(request, generation)
            finally:
                generation.close()
            if result is None:  # the client is gone; nobody reads this
                response = error_response(499, "client_closed_request", "the client closed the connection")
            else:
                tokens = result.prompt_tokens + result.completion_tokens
                response = Response(shaper.whole(result.text or "", result.finish_reason, result.prompt_tokens,
                                                 result.completion_tokens), media_type="application/json", headers=ids)
                empty = _empty_or_truncated(result)
                # a shadowed name: a copy to the candidate, after this answer, compared and discarded (issue 25)
                self.gw.shadow.generated(route, body, result.text or "", time.perf_counter() - t0, deadline_s)
        except ApiError as exc:
            response = exc.response()
        except Exception:  # a bug, not the client's fault: the JSON error shape, a request id, counted
            response = internal_error(log, request.url.path)
        response.headers.update(keyed)
        self._observe(name, model, response.status_code, t0, version, tokens, empty)
        return response

    async def _events(self, generation: Generation, shaper: Shaper, include_usage: bool, model: str,
                      t0: float, version: str | None = None) -> AsyncIterator[bytes]:
        """The SSE body of a streamed generation; cancelled by Starlette when the client disconnects."""
        stream = generation.stream
        assert stream is not None
        code, tokens, said = 200, 0, False
        try:
            if shaper.kind == CHAT:
                yield shaper.event(None, role=True)
            while True:
                event = await stream.events.get()
                if event.kind == "delta":
                    said = said or bool((event.text or "").strip())
                    yield shaper.event(event.text)
                elif event.kind == "final":
                    r = event.result
                    assert r is not None
                    tokens = r.prompt_tokens + r.completion_tokens
                    said = said or bool((r.text or "").strip())
                    yield shaper.event(None, r.finish_reason)
                    if include_usage:
                        yield shaper.usage_event(r.prompt_tokens, r.completion_tokens)
                    yield DONE
                    return
                else:
                    code = _STREAM_ERROR_STATUS.get(event.code, 500)
                    yield error_event(event.code, event.message, generation.request_id)
                    return
        except BaseException:
            code = 499  # the client went away mid-stream
            raise
        finally:
            generation.close()
            self._observe("chat" if shaper.kind == CHAT else "completions", model, code, t0, version, tokens,
                          code == 200 and not said)

    def _keyed(self, name: str, key: str | None) -> dict[str, str]:
        return routed_by(self.gw.resolver, self.gw.metrics.route_keys, name, key)

    def _observe(self, route: str, model: str, code: int, t0: float, version: str | None = None,
                 tokens: int = 0, empty: bool = False) -> None:
        self.gw.metrics.request_done(route, model, code, time.perf_counter() - t0, version, tokens, empty)

    async def models(self, request: Request) -> Response:
        try:
            self.gw.keys.check(request.headers.get("authorization"))
        except ApiError as exc:
            return exc.response()
        return Response(orjson.dumps({"object": "list", "data": self._model_list()}), media_type="application/json")

    def _model_list(self) -> list[dict[str, Any]]:
        """Every served name; a promoted one with the `version` it points to, then each of its pinned versions
        (NAME@N, `pinned_to` the name, `retires` when its window ends: epoch seconds, None for the champion)."""
        now = time.time()
        pins = self.gw.resolver.pinned()

        def row(r: Any, ident: str, **extra: Any) -> dict[str, Any]:
            info = self.gw.bases.get(r.base)
            return {"id": ident, "object": "model", "created": self.gw.created, "owned_by": "lorafleet",
                    "root": r.base, "adapter": r.adapter, "kind": info.kind_of(r.adapter) if info else None,
                    "capability": info.capability if info else None, **(info.model_fields(r.adapter) if info else {}),
                    **({"context_length": info.prompts.context} if info and info.prompts else {}), **extra}

        data = []
        splits = self.gw.resolver.splits()
        for r in self.gw.resolver.routes():
            extra: dict[str, Any] = {"version": r.version} if r.version is not None else {}
            if (split := splits.get(r.name)) is not None:  # under a canary: which version takes what share
                extra["canary"] = {"version": split.route.version, "percent": split.percent}
            data.append(row(r, r.name, **extra))
            pinned = pins.get(r.name)
            for v in pinned.live(now) if pinned is not None else ():
                data.append(row(pinned.routes[v], pinned.routes[v].model, version=v, pinned_to=r.name,
                                retires=pinned.until.get(v)))
        return data

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "gateway_id": self.gw.gateway_id})

    async def readyz(self, request: Request) -> Response:
        ready, detail = await self.gw.readiness()
        return JSONResponse(detail, status_code=200 if ready else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.gw.metrics.render(), media_type=CONTENT_TYPE)



def _empty_or_truncated(result: wire.Result) -> bool:
    """An answer with no text, whether the model stopped or was cut at max_tokens before saying anything (issue
    25: `promote --watch` compares the rate of such answers between a canary and its champion)."""
    return not (result.text or "").strip()


async def _unless_disconnected(request: Request, generation: Generation) -> wire.Result | None:
    """The generation's result, or None as soon as the client disconnects (after its whole body was read, the
    only message an ASGI server still delivers is the disconnect)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait([generation.future, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if generation.future not in done:
        return None
    return await generation.result()


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than `limit` bytes by Content-Length and by what actually arrives."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise bad_request("invalid_content_length", f"Content-Length {declared!r} is not a number") from None
        if size > limit:
            raise _too_large(size, limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, "body_too_large",
                    f"the request body has {size} bytes or more; the limit is max_body_bytes={limit}: "
                    "split the inputs over several requests")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, f"{request.method} {request.url.path}: {exc.detail}",
                          dict(exc.headers) if exc.headers else None)


def create_app(fleet: FleetConfig, *, nats_url: str | None = None, gateway_id: str | None = None,
               client: ClientSettings | None = None) -> Starlette:
    """The gateway's Starlette app; `app.state.gateway` is its Gateway (resolver, metrics, …).

    `client`: the NATS credential and TLS files (default: from the environment and the fleet file).
    """
    gateway = Gateway(fleet, nats_url=nats_url, gateway_id=gateway_id, client=client)
    r = Routes(gateway)
    rr = RerankRoutes(gateway)  # serve/rerank.py

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    routes = [
        HttpRoute("/v1/embeddings", r.embeddings, methods=["POST"]),
        HttpRoute("/v1/encode/{model}", r.encode, methods=["POST"]),
        HttpRoute("/v1/chat/completions", r.chat_completions, methods=["POST"]),
        HttpRoute("/v1/completions", r.completions, methods=["POST"]),
        HttpRoute("/v1/rerank", rr.rerank, methods=["POST"]),
        HttpRoute("/v2/rerank", rr.rerank, methods=["POST"]),
        HttpRoute("/rerank", rr.rerank_any, methods=["POST"]),
        HttpRoute("/v1/score/{model}", rr.score, methods=["POST"]),
        HttpRoute("/v1/models", r.models, methods=["GET"]),
        HttpRoute("/healthz", r.healthz, methods=["GET"]),
        HttpRoute("/readyz", r.readyz, methods=["GET"]),
        HttpRoute("/metrics", r.metrics_endpoint, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.state.gateway = gateway
    return app


def uvicorn_config(app: Starlette, host: str, port: int, log_level: str = "warning",
                   forwarded_allow_ips: str | None = None) -> Any:
    """`forwarded_allow_ips`: the proxies whose X-Forwarded-For uvicorn believes (comma-separated addresses or
    networks, "*" for any); None: $FORWARDED_ALLOW_IPS, else 127.0.0.1 only (uvicorn's default). The client address
    is a canary's route key of last resort: behind an untrusted proxy every client is the proxy."""
    import uvicorn

    # One process, uvloop + httptools, no access log: every microsecond on the request path counts.
    return uvicorn.Config(app, host=host, port=port, loop="uvloop", http="httptools", lifespan="on",
                          access_log=False, log_level=log_level, server_header=False, workers=1,
                          proxy_headers=True, forwarded_allow_ips=forwarded_allow_ips)


def run_gateway(fleet: FleetConfig, *, nats_url: str | None = None, host: str | None = None,
                port: int | None = None, gateway_id: str | None = None, log_level: str = "warning",
                client: ClientSettings | None = None, forwarded_allow_ips: str | None = None) -> None:
    """Serve the gateway until SIGINT/SIGTERM (blocking)."""
    import uvicorn

    host = host or fleet.gateway.host
    port = fleet.gateway.port if port is None else port
    app = create_app(fleet, nats_url=nats_url, gateway_id=gateway_id, client=client)
    gw: Gateway = app.state.gateway
    log.info("gateway %s on http://%s:%d, NATS %s", gw.gateway_id, host, port, gw.nats_url)
    uvicorn.Server(uvicorn_config(app, host, port, log_level, forwarded_allow_ips)).run()
