"""Hand validation of request bodies (no pydantic on the hot path); errors say what to fix."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import orjson

from lorafleet.serve.errors import ApiError, bad_request

ENCODING_FORMATS = ("float", "base64")


@dataclass(slots=True)
class EmbeddingsRequest:
    model: str
    inputs: list[str]
    encoding_format: str = "float"
    dimensions: int | None = None


@dataclass(slots=True)
class EncodeRequest:
    inputs: list[str]
    deadline_ms: float | None = None


def check_inputs(raw: Any, field: str, max_inputs: int) -> list[str]:
    """A non-empty list of non-empty strings (a single string is a list of one)."""
    if isinstance(raw, str):
        raw = [raw]
    elif not isinstance(raw, list):
        raise bad_request("invalid_input", f"'{field}' must be a string or a list of strings, got {_kind(raw)}")
    if not raw:
        raise bad_request("empty_input", f"'{field}' is an empty list; send at least one string")
    if len(raw) > max_inputs:
        raise bad_request("too_many_inputs",
                          f"'{field}' has {len(raw)} items; this gateway accepts at most {max_inputs} per request")
    for i, item in enumerate(raw):
        if not isinstance(item, str):
            raise bad_request(
                "invalid_input",
                f"{field}[{i}] is {_kind(item)}; every item must be a string (token ids are not accepted)",
            )
        if not item:
            raise bad_request("empty_input", f"{field}[{i}] is an empty string; send non-empty text")
    return raw


def load_json_object(body: bytes, expected: str) -> dict[str, Any]:
    """The JSON object of a request body; `expected` names its main keys for the error message."""
    if not body:
        raise bad_request("invalid_json", f"the request body is empty; send a JSON object with {expected}")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise bad_request("invalid_encoding", f"the request body is not UTF-8 (invalid byte at offset "
                              f"{bad.start}); send JSON encoded as UTF-8") from exc
        raise bad_request("invalid_json", f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request("invalid_json", f"the request body must be a JSON object, got {_kind(data)}")
    return data


def parse_embeddings(body: bytes, max_inputs: int) -> EmbeddingsRequest:
    """The OpenAI `POST /v1/embeddings` body; unknown keys (e.g. `user`) are ignored, as OpenAI servers do."""
    data = load_json_object(body, "'model' and 'input'")
    model = data.get("model")
    if model is None:
        raise bad_request("missing_model", "'model' is missing; GET /v1/models lists the served names")
    if not isinstance(model, str) or not model:
        raise bad_request("missing_model", f"'model' must be a non-empty string, got {_kind(model)}")
    if "input" not in data:
        raise bad_request("missing_input", "'input' is missing; send a string or a list of strings")
    inputs = check_inputs(data["input"], "input", max_inputs)
    fmt = data.get("encoding_format")
    if fmt is None:
        fmt = "float"
    elif fmt not in ENCODING_FORMATS:
        raise bad_request("invalid_encoding_format", f"'encoding_format' must be 'float' or 'base64', got {fmt!r}")
    dims = data.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise bad_request("invalid_dimensions", f"'dimensions' must be a positive integer, got {dims!r}")
    return EmbeddingsRequest(model=model, inputs=inputs, encoding_format=fmt, dimensions=dims)


def parse_encode(body: bytes, max_inputs: int) -> EncodeRequest:
    """The MessagePack `POST /v1/encode/{model}` body: {"inputs": [str, ...], "deadline_ms": number?}."""
    if not body:
        raise bad_request("invalid_msgpack", "the request body is empty; send a MessagePack map with 'inputs'")
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types (ExtraData, ValueError, UnicodeDecodeError…)
        reason = msgpack_reason(exc)
        raise bad_request("invalid_msgpack", f"the request body is not valid MessagePack: {reason}") from exc
    if not isinstance(data, dict):
        raise bad_request("invalid_msgpack", f"the request body must be a MessagePack map, got {_kind(data)}")
    if "inputs" not in data:
        raise bad_request("missing_input", "'inputs' is missing; send a list of strings")
    inputs = check_inputs(data["inputs"], "inputs", max_inputs)
    deadline = data.get("deadline_ms")
    if deadline is not None:
        deadline = _positive_ms(deadline, "deadline_ms")
    return EncodeRequest(inputs=inputs, deadline_ms=deadline)


def msgpack_reason(exc: Exception) -> str:
    """What msgpack's error means: several of its errors carry no message, or one about internal limits."""
    name, text = type(exc).__name__, str(exc)
    if isinstance(exc, msgpack.ExtraData):
        return "extra bytes after the first MessagePack object; send exactly one map"
    if isinstance(exc, UnicodeDecodeError):
        return "a string is not valid UTF-8; send text as UTF-8 (binary data as MessagePack bin)"
    if name == "FormatError":
        return "not MessagePack (a byte that starts no MessagePack type)"
    if name == "StackError":
        return "nested too deeply"
    if "incomplete input" in text or "exceeds max_" in text or not text:
        return "the data ends early (truncated MessagePack)"
    return f"{name}: {text[:200]}"


def deadline_seconds(header: str | None, body_ms: float | None, default_s: float, max_s: float) -> float:
    """The request's deadline in seconds: body `deadline_ms`, else the header, else the default; capped."""
    if body_ms is not None:
        return min(body_ms / 1000.0, max_s)
    if header is not None:
        try:
            value = float(header)
        except ValueError:
            msg = f"X-Lorafleet-Deadline-Ms must be a positive number of milliseconds, got {header!r}"
            raise ApiError(400, "invalid_deadline", msg) from None
        return min(_positive_ms(value, "X-Lorafleet-Deadline-Ms") / 1000.0, max_s)
    return min(default_s, max_s)


def _positive_ms(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ApiError(400, "invalid_deadline", f"{name} must be a positive number of milliseconds, got {value!r}")
    return float(value)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object", bytes: "bytes"}.get(type(value), type(value).__name__)
