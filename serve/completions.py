"""The OpenAI generative API: `POST /v1/chat/completions` and `POST /v1/completions` bodies in, JSON and
server-sent events out. Hand validation (no pydantic on the hot path); errors say what to fix.

Supported: `model`, `messages` (chat; `system`, `developer`, `user`, `assistant` turns, text content)
or `prompt` (completions; one string), `max_tokens` (chat also `max_completion_tokens`),
`temperature`, `top_p`, `stop` (up to 4 strings), `seed`, `n` (1), `stream`, `stream_options`
(`include_usage`), `user` (ignored). Any other parameter is refused by name, unless it carries its
neutral value (e.g. `presence_penalty: 0`, `logprobs: false`), which some clients always send.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from lorafleet.serve.errors import bad_request
from lorafleet.serve.parsing import _kind, load_json_object

CHAT, COMPLETION = "chat", "completion"
MAX_STOP = 4
ROLES = ("system", "developer", "user", "assistant")
_COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream", "stream_options", "user"}
SUPPORTED = {CHAT: _COMMON | {"messages", "max_completion_tokens"}, COMPLETION: _COMMON | {"prompt"}}
# Parameters lorafleet does not implement, with the values that mean "not used" (accepted as sent).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logprobs": (None, False),
    "top_logprobs": (None, 0), "logit_bias": (None, {}), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None, False, True), "response_format":
    (None, {"type": "text"}), "service_tier": (None, "auto", "default"), "store": (None, False),
    "metadata": (None, {}), "modalities": (None, ["text"]),
}
ROUTE_OF = {CHAT: "/v1/chat/completions", COMPLETION: "/v1/completions"}


@dataclass(slots=True)
class GenerationBody:
    """A parsed generative request; None means "not sent" (the served model's defaults apply)."""

    kind: Literal["chat", "completion"]
    model: str
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False


def parse_generation(body: bytes, kind: Literal["chat", "completion"]) -> GenerationBody:
    data = load_json_object(body, "'model' and " + ("'messages'" if kind == CHAT else "'prompt'"))
    unsupported = sorted(k for k in data if k not in SUPPORTED[kind] and data[k] not in NEUTRAL.get(k, ()))
    if unsupported:
        names = ", ".join(repr(k) for k in unsupported)
        raise bad_request("unsupported_parameter", f"{ROUTE_OF[kind]} does not support {names} (supported: "
                          f"{', '.join(sorted(SUPPORTED[kind]))})")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("missing_model", f"'model' must be a non-empty string, got {_kind(model)}; "
                          "GET /v1/models lists the served names")
    out = GenerationBody(kind=kind, model=model)
    if kind == CHAT:
        out.messages = _messages(data.get("messages"))
        limit = data.get("max_completion_tokens", data.get("max_tokens"))
        name = "max_completion_tokens" if "max_completion_tokens" in data else "max_tokens"
    else:
        out.prompt = _prompt(data.get("prompt"))
        limit, name = data.get("max_tokens"), "max_tokens"
    if limit is not None:
        out.max_tokens = _integer(limit, name, low=1)
    if data.get("temperature") is not None:
        out.temperature = _number(data["temperature"], "temperature", 0.0, 2.0)
    if data.get("top_p") is not None:
        out.top_p = _number(data["top_p"], "top_p", 0.0, 1.0)
        if out.top_p == 0.0:
            raise bad_request("invalid_parameter", "'top_p' must be greater than 0")
    out.stop = _stop(data.get("stop"))
    if data.get("seed") is not None:
        out.seed = _integer(data["seed"], "seed", low=-(2**63), high=2**63 - 1)
    n = data.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad_request("unsupported_parameter", f"'n' must be 1 (one completion per request), got {n!r}")
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("invalid_parameter", f"'stream' must be true or false, got {_kind(stream)}")
    out.stream = bool(stream)
    options = data.get("stream_options")
    if options is not None:
        if not out.stream:
            raise bad_request("invalid_parameter", "'stream_options' is only allowed with 'stream': true")
        if not isinstance(options, dict) or set(options) - {"include_usage"} or \
                not isinstance(options.get("include_usage", False), bool):
            raise bad_request("invalid_parameter", "'stream_options' supports only {\"include_usage\": true|false}")
        out.include_usage = bool(options.get("include_usage", False))
    return out


def _messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("missing_messages", f"'messages' must be a non-empty list of {{role, content}} objects, "
                          f"got {_kind(raw)}")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad_request("invalid_messages", f"messages[{i}] must be an object, got {_kind(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request("invalid_messages", f"messages[{i}].role must be one of {', '.join(ROLES)} "
                              f"(tools are not supported), got {role!r}")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise bad_request("unsupported_parameter", f"messages[{i}] has {', '.join(sorted(extra))}, which is "
                              "not supported (text turns only)")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m.get("content"), i)})
    return out


def _content(raw: Any, i: int) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                     for p in raw):
        return "".join(p["text"] for p in raw)
    raise bad_request("invalid_messages", f"messages[{i}].content must be a string or a list of text parts "
                      "(images and audio are not supported)")


def _prompt(raw: Any) -> str:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        raw = raw[0]
    if isinstance(raw, list):
        raise bad_request("unsupported_parameter", "'prompt' must be one string (a list of several prompts or of "
                          "token ids is not supported; send one request per prompt)")
    if not isinstance(raw, str) or not raw:
        raise bad_request("missing_prompt", f"'prompt' must be a non-empty string, got {_kind(raw)}")
    return raw


def _stop(raw: Any) -> list[str]:
    if raw is None:
        return []
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise bad_request("invalid_parameter", f"'stop' must be a non-empty string or a list of up to {MAX_STOP} "
                          "of them")
    return list(stops)


def _integer(value: Any, name: str, *, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an integer of at least {low}" if high is None else f"an integer in [{low}, {high}]"
        raise bad_request("invalid_parameter", f"'{name}' must be {bound}, got {value!r}")
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not low <= value <= high:
        raise bad_request("invalid_parameter", f"'{name}' must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


# -- responses ------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Shaper:
    """JSON bodies and SSE events of one response, in OpenAI's shapes."""

    kind: Literal["chat", "completion"]
    model: str
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind == CHAT else 'cmpl'}-{self.request_id}"

    def whole(self, text: str, finish_reason: str | None, prompt_tokens: int, completion_tokens: int) -> bytes:
        if self.kind == CHAT:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        return orjson.dumps({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                             "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)})

    def event(self, text: str | None, finish_reason: str | None = None, *, role: bool = False) -> bytes:
        """One `data:` event with a text delta (or the finish reason)."""
        if self.kind == CHAT:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        return sse({"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]})

    def usage_event(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        obj = "chat.completion.chunk" if self.kind == CHAT else "text_completion"
        return sse({"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                    "usage": usage(prompt_tokens, completion_tokens)})


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


_EVENT_TYPES = {"deadline_exceeded": "timeout", "invalid_request": "invalid_request_error"}


def error_event(code: str, message: str, request_id: str | None = None) -> bytes:
    """An error inside a stream (the status line has gone out already); OpenAI's clients raise on it. Like an error
    body, it names the request's id (the gateway's log has the details under it), never a worker's text."""
    error = {"code": code, "message": message, "type": _EVENT_TYPES.get(code, "server_error")}
    if request_id is not None:
        error["request_id"] = request_id
    return sse({"error": error})
