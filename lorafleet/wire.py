"""Wire types shared by the gateway and the workers: NATS subjects and MessagePack bodies.

One module, so the two sides cannot drift apart. Bodies are MessagePack maps with short,
versioned keys; vectors travel as raw little-endian float32 bytes.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

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

_TOKEN_RE = re.compile(r"[^A-Za-z0-9_-]")


class MalformedTask(ValueError):
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


@dataclass(slots=True)
class Task:
    """One input to embed. The gateway publishes one per input; workers batch them."""

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

    def to_wire(self) -> bytes:
        return pack(
            {
                "v": WIRE_VERSION,
                "id": self.id,
                "rq": self.request_id,
                "i": self.index,
                "m": self.model,
                "b": self.base,
                "t": self.text,
                "n": self.tokens,
                "dl": self.deadline,
                "r": self.reply,
                "a": self.adapter,
                "au": self.adapter_uri,
                "eq": self.enqueued,
            }
        )

    @classmethod
    def from_wire(cls, data: bytes) -> Task:
        try:
            d = unpack(data)
        except Exception as exc:  # msgpack raises several unrelated types
            raise MalformedTask(f"not MessagePack: {exc}") from exc
        if not isinstance(d, dict):
            raise MalformedTask("task body is not a map")
        if d.get("v") != WIRE_VERSION:
            raise MalformedTask(f"unsupported wire version {d.get('v')!r}")
        try:
            task = cls(
                id=d["id"],
                request_id=d["rq"],
                index=d["i"],
                model=d["m"],
                base=d["b"],
                text=d["t"],
                tokens=d["n"],
                deadline=d["dl"],
                reply=d["r"],
                adapter=d.get("a"),
                adapter_uri=d.get("au"),
                enqueued=d.get("eq", 0.0),
            )
        except KeyError as exc:
            raise MalformedTask(f"task is missing field {exc.args[0]!r}") from exc
        _check_types(task)
        return task


def _check_types(t: Task) -> None:
    checks = (
        (t.id, str), (t.request_id, str), (t.index, int), (t.model, str), (t.base, str), (t.text, str),
        (t.tokens, int), (t.deadline, (int, float)), (t.reply, str), (t.enqueued, (int, float)),
    )
    for value, kind in checks:
        if not isinstance(value, kind):
            raise MalformedTask(f"task field has wrong type: {value!r}")
    if t.adapter is not None and not isinstance(t.adapter, str):
        raise MalformedTask("adapter must be a string")
    if t.adapter_uri is not None and not isinstance(t.adapter_uri, str):
        raise MalformedTask("adapter_uri must be a string")


# Error codes a worker can send back; the gateway maps them to HTTP statuses.
ERR_DEADLINE = "deadline_exceeded"  # 504
ERR_MALFORMED = "malformed_task"  # 500: the gateway built a task the worker cannot read
ERR_ADAPTER = "adapter_unavailable"  # 503: the adapter cannot be loaded
ERR_RUNTIME = "runtime_error"  # 500: the batch failed on every delivery


@dataclass(slots=True)
class Result:
    """The answer to one task, sent over core NATS to the task's reply inbox."""

    task_id: str
    index: int
    worker: str
    vector: bytes | None = None  # float32 little-endian
    dim: int = 0
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

    def to_wire(self) -> bytes:
        return pack(
            {
                "v": WIRE_VERSION,
                "id": self.task_id,
                "i": self.index,
                "w": self.worker,
                "x": self.vector,
                "d": self.dim,
                "ec": self.error_code,
                "em": self.error_message,
                "qm": self.queue_ms,
                "bs": self.batch_size,
            }
        )

    @classmethod
    def from_wire(cls, data: bytes) -> Result:
        d = unpack(data)
        if not isinstance(d, dict) or d.get("v") != WIRE_VERSION:
            raise ValueError("not a lorafleet result")
        return cls(
            task_id=d["id"],
            index=d["i"],
            worker=d["w"],
            vector=d.get("x"),
            dim=d.get("d", 0),
            error_code=d.get("ec"),
            error_message=d.get("em"),
            queue_ms=d.get("qm", 0.0),
            batch_size=d.get("bs", 0),
        )


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
        return pack(
            {
                "v": WIRE_VERSION,
                "w": self.worker,
                "b": self.bases,
                "a": self.adapters,
                "f": self.in_flight,
                "bps": self.batches_per_s,
                "td": self.tasks_done,
                "pid": self.pid,
                "h": self.host,
                "ts": self.ts,
                "dr": self.draining,
            }
        )

    @classmethod
    def from_wire(cls, data: bytes) -> Heartbeat:
        d = unpack(data)
        return cls(
            worker=d["w"],
            bases=list(d["b"]),
            adapters={k: list(v) for k, v in d["a"].items()},
            in_flight=d["f"],
            batches_per_s=d["bps"],
            tasks_done=d["td"],
            pid=d["pid"],
            host=d["h"],
            ts=d["ts"],
            draining=d.get("dr", False),
        )


# The MessagePack HTTP route, POST /v1/encode/{model}:
#   request  {"inputs": [str, ...], "deadline_ms": int?}
#   response {"model": str, "dim": int, "vectors": [bytes(float32 × dim), ...], "prompt_tokens": int}
def encode_response(model: str, vectors: list[bytes], dim: int, prompt_tokens: int) -> bytes:
    return pack({"model": model, "dim": dim, "vectors": vectors, "prompt_tokens": prompt_tokens})
