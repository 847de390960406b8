"""Reranking: `POST /v1/rerank`, `/v2/rerank`, `/rerank` and the MessagePack `POST /v1/score/{model}`.

Request and response shapes are those Cohere v2, Jina, vLLM and Infinity share:
`{model, query, documents, top_n?, return_documents?}` → `{model, results: [{index, relevance_score,
document?}], usage}`, results sorted by score (ties keep input order), at most `top_n` of them. A
document is a string or `{"text": str}`. `/rerank` with `texts` instead of `documents` speaks TEI's
shape: `{query, texts, return_text?}` → a bare list `[{index, score, text?}]`.

How a request travels: the documents are cut into chunks of `gateway.rerank_chunk`, one `score` task
per chunk (the query with the chunk's documents), all published together through the same path as a
multi-input embedding (admitted whole, answered in full or failed explicitly). A 1,000-document
request is thus spread over many tasks and workers instead of holding one worker for all of it, and a
few small requests' chunks still fill one batch. Pairs longer than the model reads (`BaseInfo.max_length`)
are truncated by the worker; the response lists them (`truncated`, and a warning in `meta`).

A rerank base whose checkpoint has no score head (`BaseInfo.untrained`: the loader drew one, it ranks at chance)
is served only for the specialists that attach to it: a request naming the base itself is answered 409
`untrained_head`, with what to do (train and promote a rerank specialist), before anything is published.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response

from lorafleet.core import wire
from lorafleet.models.checkpoints import untrained_head_message
from lorafleet.serve.errors import ApiError, bad_request, internal_error
from lorafleet.serve.gateway import Gateway
from lorafleet.serve.parsing import deadline_seconds, load_json_object, msgpack_reason
from lorafleet.serve.resolver import Route
from lorafleet.serve.routekeys import routed_by

log = logging.getLogger("lorafleet.serve")

DEADLINE_HEADER = "x-lorafleet-deadline-ms"
MSGPACK = "application/msgpack"
_INLINE_CHARS = 32_768  # more text than this is tokenized in the gateway's token thread


@dataclass(slots=True)
class RerankRequest:
    model: str | None  # None: TEI, which names no model (the one reranker served)
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = False
    tei: bool = False
    deadline_ms: float | None = None


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _documents(raw: Any, field: str, max_documents: int) -> list[str]:
    if not isinstance(raw, list):
        raise bad_request("invalid_documents", f"'{field}' must be a list of strings (or of {{\"text\": str}}), "
                          f"got {_kind(raw)}")
    if not raw:
        raise bad_request("empty_documents", f"'{field}' is an empty list; send at least one document")
    if len(raw) > max_documents:
        raise bad_request("too_many_documents", f"'{field}' has {len(raw)} documents; this gateway reranks at most "
                          f"{max_documents} per request (gateway.max_rerank_documents): split them over requests")
    out: list[str] = []
    for i, doc in enumerate(raw):
        if isinstance(doc, dict) and isinstance(doc.get("text"), str):
            doc = doc["text"]
        if not isinstance(doc, str):
            raise bad_request("invalid_document", f"{field}[{i}] is {_kind(doc)}; every document must be a string "
                              "or an object {\"text\": str}")
        out.append(doc)
    return out


def _query(data: dict[str, Any]) -> str:
    query = data.get("query")
    if not isinstance(query, str):
        raise bad_request("invalid_query", f"'query' must be a string, got {_kind(query)}")
    if not query.strip():
        raise bad_request("empty_query", "'query' is empty; send the text to rank the documents against")
    return query


def _top_n(raw: Any) -> int | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
        raise bad_request("invalid_top_n", f"'top_n' must be a positive integer (or omitted for all), got {raw!r}")
    return raw


def _flag(data: dict[str, Any], key: str) -> bool:
    value = data.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request("invalid_parameter", f"'{key}' must be true or false, got {_kind(value)}")
    return value


def parse_rerank(body: bytes, max_documents: int, tei_allowed: bool = False) -> RerankRequest:
    """A JSON rerank body: the Cohere/Jina shape, or (on `/rerank`) TEI's, told apart by `texts`."""
    data = load_json_object(body, "'model', 'query' and 'documents'")
    query = _query(data)
    if tei_allowed and "texts" in data and "documents" not in data:
        if data.get("raw_scores"):
            raise bad_request("unsupported_parameter", "'raw_scores': true is not supported; scores are the "
                              "model's relevance scores (omit it or send false)")
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            raise bad_request("invalid_model", f"'model' must be a string, got {_kind(model)}")
        return RerankRequest(model, query, _documents(data["texts"], "texts", max_documents),
                             return_documents=_flag(data, "return_text"), tei=True)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("invalid_model", f"'model' must name a served reranker, got {_kind(model)}")
    if "documents" not in data:
        raise bad_request("missing_documents", "'documents' is missing; send a list of strings to rank")
    return RerankRequest(model, query, _documents(data["documents"], "documents", max_documents),
                         top_n=_top_n(data.get("top_n")), return_documents=_flag(data, "return_documents"))


def parse_score(body: bytes, max_documents: int) -> RerankRequest:
    """The MessagePack `POST /v1/score/{model}` body: {"query": str, "documents": [str], "deadline_ms"?}."""
    if not body:
        raise bad_request("invalid_msgpack", "the request body is empty; send a MessagePack map with 'query' and "
                          "'documents'")
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise bad_request("invalid_msgpack", f"the request body is not valid MessagePack: {msgpack_reason(exc)}"
                          ) from exc
    if not isinstance(data, dict):
        raise bad_request("invalid_msgpack", f"the request body must be a MessagePack map, got {_kind(data)}")
    deadline = data.get("deadline_ms")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, int | float)
                                 or not math.isfinite(deadline) or deadline <= 0):
        raise ApiError(400, "invalid_deadline", f"deadline_ms must be a positive number of milliseconds, got "
                       f"{deadline!r}")
    return RerankRequest(None, _query(data), _documents(data.get("documents"), "documents", max_documents),
                         deadline_ms=deadline)


@dataclass(slots=True)
class Scored:
    scores: np.ndarray  # float32, one per document, input order
    tokens: int  # what the model read (truncated pairs count at the model's length)
    truncated: list[int]  # documents whose pair was cut to the model's length


async def score(gw: Gateway, route: Route, query: str, documents: list[str], deadline_s: float) -> Scored:
    """Count, chunk, publish and await: the relevance of each document to `query`, in input order."""
    info = gw.require(route, wire.SCORE)
    if route.adapter is None and info.untrained:
        raise untrained_head(route.name)
    counter = gw.tokens[route.base]
    texts = [query, *documents]
    if sum(len(t) for t in texts) <= _INLINE_CHARS:
        counts = counter.count(texts)
    else:
        counts = await gw._in_token_thread(counter.count_in_thread, texts)  # same stage: the one token thread
    q = counts[0]
    if q > gw.cfg.max_input_tokens:
        raise bad_request("query_too_long", f"'query' has {q} tokens; the limit is max_input_tokens="
                          f"{gw.cfg.max_input_tokens} for model {route.name!r}: shorten it")
    # [CLS] query [SEP] document [SEP]: both counts carry their own [CLS]/[SEP], the pair one fewer.
    pairs = [q + d - 1 for d in counts[1:]]
    limit = info.max_length
    truncated = [i for i, n in enumerate(pairs) if limit is not None and n > limit]
    read = [min(n, limit) if limit is not None else n for n in pairs]
    size = gw.cfg.rerank_chunk
    chunks = [range(a, min(a + size, len(documents))) for a in range(0, len(documents), size)]
    params = [wire.ScoreParams(tuple(documents[i] for i in c)).to_params() for c in chunks]
    tokens = [len(c) * max(read[i] for i in c) for c in chunks]  # padded: what the worker's budget counts
    results = await gw.run_tasks(route, [query] * len(chunks), tokens, deadline_s, wire.SCORE, params)
    parts: list[np.ndarray] = []
    for c, r in zip(chunks, results, strict=True):
        got = r.score_array() if r.scores is not None else np.zeros(0, dtype=np.float32)
        if got.shape != (len(c),):
            raise ApiError(500, "malformed_result", f"a worker answered {got.size} scores for a chunk of {len(c)} "
                           "documents")
        parts.append(got)
    return Scored(np.concatenate(parts), sum(read), truncated)


def ranked(scores: np.ndarray, top_n: int | None) -> list[int]:
    """Document indices by descending score; equal scores keep input order (a stable sort)."""
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
    return order if top_n is None else order[:top_n]


def untrained_head(name: str) -> ApiError:
    """409: `name` is a rerank base whose head was drawn at load; the message says what to do."""
    return ApiError(409, "untrained_head", untrained_head_message(name))


def only_reranker(gw: Gateway) -> str:
    """The served name a TEI request (which names no model) means: the one reranker served (a rerank base whose
    head was drawn at load does not count), else 409 when only such bases are served, else 400."""
    names: list[str] = []
    untrained: list[str] = []
    for r in gw.resolver.routes():
        if (info := gw.bases.get(r.base)) is not None and info.capability == wire.SCORE:
            (untrained if r.adapter is None and info.untrained else names).append(r.name)
    if len(names) == 1:
        return names[0]
    if not names and untrained:
        raise untrained_head(untrained[0])
    raise bad_request("missing_model", "this gateway serves " + (f"{len(names)} rerankers ({', '.join(names)}); "
                      "name one in 'model'" if names else "no reranker"))


class RerankRoutes:
    """The rerank handlers of one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    def _deadline(self, request: Request, body_ms: float | None = None) -> float:
        return deadline_seconds(request.headers.get(DEADLINE_HEADER), body_ms, self.gw.cfg.default_deadline_s,
                                self.gw.cfg.max_deadline_s)

    async def rerank(self, request: Request) -> Response:
        """`/v1/rerank`, `/v2/rerank`: Cohere/Jina shape."""
        return await self._json(request, tei_allowed=False)

    async def rerank_any(self, request: Request) -> Response:
        """`/rerank`: Jina's path (LlamaIndex JinaRerank), or TEI's body shape when it sends `texts`."""
        return await self._json(request, tei_allowed=True)

    async def _json(self, request: Request, tei_allowed: bool) -> Response:
        from lorafleet.serve.routes import read_body  # the body limit, shared with every route

        t0 = time.perf_counter()
        model, version = "_invalid", None
        keyed: dict[str, str] = {}  # which route key a canary's split used (issue 38)
        try:
            self.gw.keys.check(request.headers.get("authorization"))
            req = parse_rerank(await read_body(request, self.gw.cfg.max_body_bytes),
                               self.gw.cfg.max_rerank_documents, tei_allowed)
            name, key = req.model if req.model is not None else only_reranker(self.gw), self.gw.route_key(request)
            route = self.gw.resolve(name, key)  # a canary's sticky split (issue 25)
            keyed = routed_by(self.gw.resolver, self.gw.metrics.route_keys, name, key)
            model, version = route.name, route.version
            deadline_s = self._deadline(request)
            out = await score(self.gw, route, req.query, req.documents, deadline_s)
            order = ranked(out.scores, req.top_n)
            # a shadowed name: a copy to the candidate after this answer, compared and discarded (issue 25)
            self.gw.shadow.reranked(route, req.model or route.name, req.query, req.documents,
                                    ranked(out.scores, None), time.perf_counter() - t0, deadline_s)
            if req.tei:
                body: Any = [{"index": i, "score": float(out.scores[i]),
                              **({"text": req.documents[i]} if req.return_documents else {})} for i in order]
            else:
                body = {"model": route.model,  # the exact version that scored (NAME@N)
                        "results": [{"index": i, "relevance_score": float(out.scores[i]),
                                     **({"document": {"text": req.documents[i]}} if req.return_documents else {})}
                                    for i in order],
                        "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens}}
                if out.truncated:
                    body["truncated"] = out.truncated
                    body["meta"] = {"warnings": [f"{len(out.truncated)} document(s) were truncated to the model's "
                                                 "maximum length (see 'truncated')"]}
            response = Response(orjson.dumps(body), media_type="application/json")
        except ApiError as exc:
            response = exc.response()
        except Exception:  # a bug, not the client's fault: the JSON error shape, a request id, counted
            response = internal_error(log, request.url.path)
        response.headers.update(keyed)
        self.gw.metrics.request_done("rerank", model, response.status_code, time.perf_counter() - t0, version)
        return response

    async def score(self, request: Request) -> Response:
        """`POST /v1/score/{model}` (MessagePack): {model, scores: bytes(float32 × n), prompt_tokens, truncated}."""
        from lorafleet.serve.routes import read_body

        t0 = time.perf_counter()
        model, version = "_invalid", None
        keyed: dict[str, str] = {}
        try:
            self.gw.keys.check(request.headers.get("authorization"))
            key = self.gw.route_key(request)
            route = self.gw.resolve(request.path_params["model"], key)
            keyed = routed_by(self.gw.resolver, self.gw.metrics.route_keys, request.path_params["model"], key)
            model, version = route.name, route.version
            self.gw.require(route, wire.SCORE)
            req = parse_score(await read_body(request, self.gw.cfg.max_body_bytes), self.gw.cfg.max_rerank_documents)
            out = await score(self.gw, route, req.query, req.documents, self._deadline(request, req.deadline_ms))
            body = wire.pack({"model": route.model, "scores": out.scores.astype("<f4").tobytes(),
                              "prompt_tokens": out.tokens, "truncated": out.truncated})
            response = Response(body, media_type=MSGPACK)
        except ApiError as exc:
            response = exc.response()
        except Exception:
            response = internal_error(log, request.url.path)
        response.headers.update(keyed)
        self.gw.metrics.request_done("score", model, response.status_code, time.perf_counter() - t0, version)
        return response


__all__ = ["RerankRequest", "RerankRoutes", "parse_rerank", "parse_score", "ranked", "score"]
