"""Wire types shared by the gateway and the workers: NATS subjects and MessagePack bodies.

One module, so the two sides cannot drift apart. Bodies are MessagePack maps with short,
versioned keys; vectors travel as raw little-endian float32 bytes. Every body is decoded by the
same strict reader (`_read`): a missing field, a field of the wrong type or an unknown version is
a `WireError` that names the field, whichever body it is.

A result carries the payload of one capability: `vector` (+ `dim`) for embed, `text` with token
usage and a finish reason for generate, or an error code.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack
import numpy as np

WIRE_VERSION = 1

WORK_PREFIX = "lorafleet.work"
DLQ_PREFIX = "lorafleet.dlq"
HEARTBEAT_PREFIX = "lorafleet.heartbeat"
INBOX_PREFIX = "_INBOX"
FLEET_KV_BUCKET = "lorafleet_fleet"

# Header names.
HDR_MSG_ID = "Nats-Msg-Id"
HDR_DLQ_REASON = "Lorafleet-Dlq-Reason"
HDR_DLQ_SUBJECT = "Lorafleet-Dlq-Subject"
HDR_DLQ_DELIVERIES = "Lorafleet-Dlq-Deliveries"

# Capabilities: what a runtime can do and what a task asks for.
EMBED: Final = "embed"
GENERATE: Final = "generate"
CAPABILITIES: Final = (EMBED, GENERATE)

_TOKEN_RE = re.compile(r"[^A-Za-z0-9_-]")


class WireError(ValueError):
    """A body that is not a valid lorafleet message; the message names what is wrong."""


class MalformedTask(WireError):
    """A task body that cannot be decoded into a Task; it is terminated and dead-lettered."""


def subject_token(name: str) -> str:
    """A NATS subject token for a model name ('.', '*', '>' and spaces are not allowed in one)."""
    token = _TOKEN_RE.sub("_", name)
    if not token:
        raise ValueError("empty model name")
    return token


def work_subject(base: str) -> str:
    return f"{WORK_PREFIX}.{subject_token(base)}"


def dlq_subject(base: str) -> str:
    return f"{DLQ_PREFIX}.{subject_token(base)}"


def consumer_name(base: str) -> str:
    """The durable pull consumer shared by every worker of one base model."""
    return f"workers-{subject_token(base)}"


def heartbeat_subject(worker_id: str) -> str:
    return f"{HEARTBEAT_PREFIX}.{subject_token(worker_id)}"


def inbox_prefix(gateway_id: str) -> str:
    return f"{INBOX_PREFIX}.{subject_token(gateway_id)}"


def reply_inbox(gateway_id: str, request_id: str) -> str:
    return f"{inbox_prefix(gateway_id)}.{subject_token(request_id)}"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


# -- the one strict reader -------------------------------------------------------------------------

_NUMBER = (int, float)
_REQUIRED = object()


def _read(data: bytes, what: str, spec: dict[str, tuple[Any, Any]], error: type[WireError] = WireError
          ) -> dict[str, Any]:
    """The fields of a versioned MessagePack map, checked against `spec` = {key: (types, default)}.

    A default of `_REQUIRED` makes the key mandatory; a default of None also admits None. bool is
    not accepted where a number is expected (MessagePack keeps them apart; Python does not).
    """
    try:
        d = unpack(data)
    except Exception as exc:  # msgpack raises several unrelated types
        raise error(f"{what} is not MessagePack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(d, dict):
        raise error(f"{what} body is not a map")
    if d.get("v") != WIRE_VERSION:
        raise error(f"{what} has unsupported wire version {d.get('v')!r} (this side speaks {WIRE_VERSION})")
    out: dict[str, Any] = {}
    for key, (types, default) in spec.items():
        if key not in d:
            if default is _REQUIRED:
                raise error(f"{what} is missing field {key!r}")
            out[key] = default
            continue
        value = d[key]
        if value is None and default is None:
            out[key] = None
        elif isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise error(f"{what} field {key!r} has the wrong type: bool")
        elif not isinstance(value, types):
            raise error(f"{what} field {key!r} has the wrong type: {type(value).__name__}")
        else:
            out[key] = value
    return out


_TASK_SPEC: Final[dict[str, tuple[Any, Any]]] = {
    "id": (str, _REQUIRED), "rq": (str, _REQUIRED), "i": (int, _REQUIRED), "m": (str, _REQUIRED),
    "b": (str, _REQUIRED), "t": (str, _REQUIRED), "n": (int, _REQUIRED), "dl": (_NUMBER, _REQUIRED),
    "r": (str, _REQUIRED), "a": (str, None), "au": (str, None), "eq": (_NUMBER, 0.0), "op": (str, EMBED),
    "p": (dict, None),
}


@dataclass(slots=True)
class Task:
    """One input. The gateway publishes one per input; workers batch them.

    `op` names the capability asked for; `params` carries its per-task settings (for generate:
    sampling and length limits), absent for embed.
    """

    id: str  # unique per task, also the Nats-Msg-Id (dedup)
    request_id: str
    index: int  # position in the request's input list
    model: str  # the served name the client asked for
    base: str
    text: str
    tokens: int
    deadline: float  # unix seconds; past it, nobody waits for the answer
    reply: str  # core-NATS inbox of the gateway
    adapter: str | None = None  # adapter id (cache key), None for the bare base model
    adapter_uri: str | None = None  # where a worker loads the adapter from
    enqueued: float = field(default_factory=time.time)
    op: str = EMBED
    params: dict[str, Any] | None = None

    def to_wire(self) -> bytes:
        body: dict[str, Any] = {
            "v": WIRE_VERSION, "id": self.id, "rq": self.request_id, "i": self.index, "m": self.model,
            "b": self.base, "t": self.text, "n": self.tokens, "dl": self.deadline, "r": self.reply,
            "a": self.adapter, "au": self.adapter_uri, "eq": self.enqueued,
        }
        if self.op != EMBED:
            body["op"] = self.op
        if self.params is not None:
            body["p"] = self.params
        return pack(body)

    @classmethod
    def from_wire(cls, data: bytes) -> Task:
        d = _read(data, "task", _TASK_SPEC, MalformedTask)
        if d["op"] not in CAPABILITIES:
            raise MalformedTask(f"task field 'op' is {d['op']!r}; expected one of {', '.join(CAPABILITIES)}")
        return cls(id=d["id"], request_id=d["rq"], index=d["i"], model=d["m"], base=d["b"], text=d["t"],
                   tokens=d["n"], deadline=d["dl"], reply=d["r"], adapter=d["a"], adapter_uri=d["au"],
                   enqueued=d["eq"], op=d["op"], params=d["p"])


# Error codes a worker can send back; the gateway maps them to HTTP statuses.
ERR_DEADLINE = "deadline_exceeded"  # 504
ERR_MALFORMED = "malformed_task"  # 500: the gateway built a task the worker cannot read
ERR_ADAPTER = "adapter_unavailable"  # 503: the adapter cannot be loaded
ERR_RUNTIME = "runtime_error"  # 500: the batch failed on every delivery


_RESULT_SPEC: Final[dict[str, tuple[Any, Any]]] = {
    "id": (str, _REQUIRED), "i": (int, _REQUIRED), "w": (str, _REQUIRED), "x": (bytes, None), "d": (int, 0),
    "tx": (str, None), "pt": (int, 0), "ct": (int, 0), "fr": (str, None), "ec": (str, None),
    "em": (str, None), "qm": (_NUMBER, 0.0), "bs": (int, 0),
}


@dataclass(slots=True)
class Result:
    """The answer to one task, sent over core NATS to the task's reply inbox (as a request: see sidecar)."""

    task_id: str
    index: int
    worker: str
    vector: bytes | None = None  # embed: float32 little-endian
    dim: int = 0
    text: str | None = None  # generate: the completion
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    queue_ms: float = 0.0  # enqueue → batch start
    batch_size: int = 0

    @property
    def ok(self) -> bool:
        return self.error_code is None

    def array(self) -> np.ndarray:
        assert self.vector is not None
        return np.frombuffer(self.vector, dtype="<f4")

    def check(self) -> str | None:
        """Why a successful result cannot be used (a vector of the wrong size, no payload), or None."""
        if self.error_code is not None:
            return None
        if self.vector is not None:
            if self.dim <= 0 or len(self.vector) != 4 * self.dim:
                return f"result has {len(self.vector)} vector bytes for dim {self.dim}"
            return None
        if self.text is None:
            return "result carries neither a vector nor a text"
        return None

    def to_wire(self) -> bytes:
        body: dict[str, Any] = {"v": WIRE_VERSION, "id": self.task_id, "i": self.index, "w": self.worker,
                                "qm": self.queue_ms, "bs": self.batch_size}
        if self.vector is not None:
            body["x"], body["d"] = self.vector, self.dim
        if self.text is not None:
            body.update(tx=self.text, pt=self.prompt_tokens, ct=self.completion_tokens, fr=self.finish_reason)
        if self.error_code is not None:
            body["ec"], body["em"] = self.error_code, self.error_message
        return pack(body)

    @classmethod
    def from_wire(cls, data: bytes) -> Result:
        d = _read(data, "result", _RESULT_SPEC)
        return cls(task_id=d["id"], index=d["i"], worker=d["w"], vector=d["x"], dim=d["d"], text=d["tx"],
                   prompt_tokens=d["pt"], completion_tokens=d["ct"], finish_reason=d["fr"], error_code=d["ec"],
                   error_message=d["em"], queue_ms=d["qm"], batch_size=d["bs"])


_HEARTBEAT_SPEC: Final[dict[str, tuple[Any, Any]]] = {
    "w": (str, _REQUIRED), "b": (list, _REQUIRED), "a": (dict, _REQUIRED), "f": (int, _REQUIRED),
    "bps": (_NUMBER, _REQUIRED), "td": (int, _REQUIRED), "pid": (int, _REQUIRED), "h": (str, _REQUIRED),
    "ts": (_NUMBER, _REQUIRED), "dr": (bool, False),
}


@dataclass(slots=True)
class Heartbeat:
    """What a worker tells the fleet about itself, every `heartbeat_s`. Never used for routing."""

    worker: str
    bases: list[str]
    adapters: dict[str, list[str]]  # base → loaded adapter ids
    in_flight: int
    batches_per_s: float
    tasks_done: int
    pid: int
    host: str
    ts: float = field(default_factory=time.time)
    draining: bool = False

    def to_wire(self) -> bytes:
        return pack({"v": WIRE_VERSION, "w": self.worker, "b": self.bases, "a": self.adapters, "f": self.in_flight,
                     "bps": self.batches_per_s, "td": self.tasks_done, "pid": self.pid, "h": self.host,
                     "ts": self.ts, "dr": self.draining})

    @classmethod
    def from_wire(cls, data: bytes) -> Heartbeat:
        d = _read(data, "heartbeat", _HEARTBEAT_SPEC)
        if not all(isinstance(b, str) for b in d["b"]):
            raise WireError("heartbeat field 'b' must be a list of strings")
        adapters = d["a"]
        if not all(isinstance(k, str) and isinstance(v, list) and all(isinstance(x, str) for x in v)
                   for k, v in adapters.items()):
            raise WireError("heartbeat field 'a' must map base names to lists of adapter ids")
        return cls(worker=d["w"], bases=list(d["b"]), adapters={k: list(v) for k, v in adapters.items()},
                   in_flight=d["f"], batches_per_s=d["bps"], tasks_done=d["td"], pid=d["pid"], host=d["h"],
                   ts=d["ts"], draining=d["dr"])


# The MessagePack HTTP route, POST /v1/encode/{model}:
#   request  {"inputs": [str, ...], "deadline_ms": int?}
#   response {"model": str, "dim": int, "vectors": [bytes(float32 × dim), ...], "prompt_tokens": int}
def encode_response(model: str, vectors: list[bytes], dim: int, prompt_tokens: int) -> bytes:
    return pack({"model": model, "dim": dim, "vectors": vectors, "prompt_tokens": prompt_tokens})
