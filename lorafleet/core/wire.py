"""Wire types shared by the gateway and the workers: NATS subjects and MessagePack bodies.

One module, so the two sides cannot drift apart. Bodies are MessagePack maps with short,
versioned keys; vectors travel as raw little-endian float32 bytes. Every body is decoded by the
same strict reader (`wire_reader.read_body`): a missing field, a field of the wrong type or an unknown version is
a `WireError` that names the field, whichever body it is.

A result carries the payload of one capability: `vector` (+ `dim`) for embed, `text` with token
usage and a finish reason for generate, `scores` (raw float32, one per document of the task's
`ScoreParams`) for score, or an error code. A generate task that asks for streaming
is answered with text chunks first (a Result with `seq` and no finish reason, core-NATS publishes in
order) and then the final Result (whole text, usage, finish reason, number of chunks sent), which
goes with a receipt like every final result. `attempt` (the JetStream delivery) tells a gateway which
chunks belong together when a task is delivered again after a worker died mid-stream.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from lorafleet.core.task_params import GenerateParams as GenerateParams  # re-exported: named from wire
from lorafleet.core.task_params import ScoreParams as ScoreParams
from lorafleet.core.wire_reader import NUMBER, REQUIRED, WIRE_VERSION, MalformedTask, WireError, pack, read_body
from lorafleet.core.wire_reader import unpack as unpack

WORK_PREFIX = "lorafleet.work"
DLQ_PREFIX = "lorafleet.dlq"
HEARTBEAT_PREFIX = "lorafleet.heartbeat"
PRESENCE_PREFIX = "lorafleet.presence"  # .<role>.<name>: every process says it runs (heartbeats.Presence)
INBOX_PREFIX = "_INBOX"
FLEET_KV_BUCKET = "lorafleet_fleet"  # served names, staged preloads, promote locks: control writes it
FLEET_CONFIG_KV_BUCKET = "lorafleet_config"  # the fleet file for hosts that join: only admin writes it

# Header names.
HDR_MSG_ID = "Nats-Msg-Id"
HDR_DLQ_REASON = "Lorafleet-Dlq-Reason"
HDR_DLQ_SUBJECT = "Lorafleet-Dlq-Subject"
HDR_DLQ_DELIVERIES = "Lorafleet-Dlq-Deliveries"

# A gateway confirms every request on its inbox with a receipt: empty while the request is pending,
# this body once nobody waits for it any more (answered, timed out, client gone), so a worker stops
# generating text nobody reads.
RECEIPT_CANCEL = b"cancel"

# Capabilities: what a runtime can do and what a task asks for.
EMBED: Final = "embed"
GENERATE: Final = "generate"
SCORE: Final = "score"  # (query, document) pairs → one relevance float each: a cross-encoder (rerank)
CAPABILITIES: Final = (EMBED, GENERATE, SCORE)

_TOKEN_RE = re.compile(r"[^A-Za-z0-9_-]")


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


def presence_subject(role: str, name: str) -> str:
    return f"{PRESENCE_PREFIX}.{subject_token(role)}.{subject_token(name)}"


def inbox_prefix(gateway_id: str) -> str:
    return f"{INBOX_PREFIX}.{subject_token(gateway_id)}"


def reply_inbox(gateway_id: str, request_id: str) -> str:
    return f"{inbox_prefix(gateway_id)}.{subject_token(request_id)}"


_TASK_SPEC: Final[dict[str, tuple[Any, Any]]] = {
    "id": (str, REQUIRED), "rq": (str, REQUIRED), "i": (int, REQUIRED), "m": (str, REQUIRED),
    "b": (str, REQUIRED), "t": (str, REQUIRED), "n": (int, REQUIRED), "dl": (NUMBER, REQUIRED),
    "r": (str, REQUIRED), "a": (str, None), "au": (str, None), "eq": (NUMBER, 0.0), "op": (str, EMBED),
    "p": (dict, None),
}


@dataclass(slots=True)
class Task:
    """One input. The gateway publishes one per input; workers batch them.

    `op` names the capability asked for; `params` carries its per-task settings (for generate:
    sampling and length limits), absent for embed. `deadline` and `enqueued` are both the gateway's clock:
    their difference is the task's budget, which a worker on another host can trust without trusting that
    its own clock agrees with the gateway's (lorafleet/core/deadlines.py).
    """

    id: str  # unique per task, also the Nats-Msg-Id (dedup)
    request_id: str
    index: int  # position in the request's input list
    model: str  # the served name the client asked for
    base: str
    text: str
    tokens: int
    deadline: float  # unix seconds on the gateway's clock; past it, nobody waits (workers: deadlines.py)
    reply: str  # core-NATS inbox of the gateway
    adapter: str | None = None  # adapter id (cache key), None for the bare base model
    adapter_uri: str | None = None  # where a worker loads the adapter from
    enqueued: float = field(default_factory=time.time)  # the gateway's clock at publish (0: not sent)
    op: str = EMBED
    params: dict[str, Any] | None = None
    # Not on the wire: the deadline on the clock of the worker holding the task, fixed once when it is taken
    # (deadlines.local_deadline), so a skewed worker clock neither drops live work nor computes dead work.
    expires: float | None = field(default=None, compare=False, repr=False)

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
        d = read_body(data, "task", _TASK_SPEC, MalformedTask)
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
ERR_INVALID = "invalid_request"  # 400: the runtime refused the task's input or parameters (not worth a retry)


_RESULT_SPEC: Final[dict[str, tuple[Any, Any]]] = {
    "id": (str, REQUIRED), "i": (int, REQUIRED), "w": (str, REQUIRED), "x": (bytes, None), "d": (int, 0),
    "tx": (str, None), "pt": (int, 0), "ct": (int, 0), "fr": (str, None), "ec": (str, None),
    "em": (str, None), "qm": (NUMBER, 0.0), "bs": (int, 0),
    "sq": (int, None), "at": (int, 0),  # optional (issue 14): streamed text
    "sc": (bytes, None),  # optional (issue 26): score, float32 little-endian, one per document of the task
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
    # Streaming (generate): a chunk has `seq` (0, 1, …) and a text delta but no finish reason; the final
    # result has the whole text, the finish reason and, in `seq`, how many chunks went before it.
    seq: int | None = None
    attempt: int = 0  # the task's delivery (JetStream num_delivered) this text comes from
    scores: bytes | None = None  # score: float32 little-endian, one per document of the task, in order

    @property
    def ok(self) -> bool:
        return self.error_code is None

    @property
    def is_chunk(self) -> bool:
        return self.seq is not None and self.finish_reason is None and self.error_code is None

    def array(self) -> np.ndarray:
        assert self.vector is not None
        return np.frombuffer(self.vector, dtype="<f4")

    def score_array(self) -> np.ndarray:
        assert self.scores is not None
        return np.frombuffer(self.scores, dtype="<f4")

    def check(self) -> str | None:
        """Why a successful result cannot be used (a vector of the wrong size, no payload), or None."""
        if self.error_code is not None:
            return None
        if self.scores is not None:
            if not self.scores or len(self.scores) % 4:
                return f"result has {len(self.scores)} score bytes, not a whole number of float32"
            return None
        if self.vector is not None:
            if self.dim <= 0 or len(self.vector) != 4 * self.dim:
                return f"result has {len(self.vector)} vector bytes for dim {self.dim}"
            return None
        if self.text is None:
            return "result carries neither a vector nor a text"
        if self.seq is not None and self.seq < 0:
            return f"result has a negative chunk sequence number {self.seq}"
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
        if self.seq is not None:
            body["sq"] = self.seq
        if self.scores is not None:
            body["sc"] = self.scores
        if self.attempt:
            body["at"] = self.attempt
        return pack(body)

    @classmethod
    def from_wire(cls, data: bytes) -> Result:
        d = read_body(data, "result", _RESULT_SPEC)
        return cls(task_id=d["id"], index=d["i"], worker=d["w"], vector=d["x"], dim=d["d"], text=d["tx"],
                   prompt_tokens=d["pt"], completion_tokens=d["ct"], finish_reason=d["fr"], error_code=d["ec"],
                   error_message=d["em"], queue_ms=d["qm"], batch_size=d["bs"], seq=d["sq"], attempt=d["at"],
                   scores=d["sc"])


_HEARTBEAT_SPEC: Final[dict[str, tuple[Any, Any]]] = {
    "w": (str, REQUIRED), "b": (list, REQUIRED), "a": (dict, REQUIRED), "f": (int, REQUIRED),
    "bps": (NUMBER, REQUIRED), "td": (int, REQUIRED), "pid": (int, REQUIRED), "h": (str, REQUIRED),
    "ts": (NUMBER, REQUIRED), "dr": (bool, False),
    "sr": (dict, None),  # optional (issue 12): absent from older workers, read as {}
    "su": (dict, None), "sn": (dict, None), "kv": (dict, None),  # optional (issue 14): engine runtimes
    "pr": (dict, None),  # optional (issue 27): base → precision served
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
    # base → tasks this worker completes per second while busy with that base (its measured service
    # rate, what gateways admit work by); a base it has not computed yet is absent.
    service_rates: dict[str, float] = field(default_factory=dict)
    # Engine runtimes (issue 14), per base: sequences in flight, sequences the worker keeps in flight
    # at most (its slot target), and the engine's KV-cache use (0..1). Absent for batch runtimes.
    slots_used: dict[str, int] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)
    kv_cache: dict[str, float] = field(default_factory=dict)
    # base → the precision it is served at (fp32, bf16, fp16, int8; lorafleet/models/precision.py);
    # absent from older workers.
    precisions: dict[str, str] = field(default_factory=dict)

    def to_wire(self) -> bytes:
        body = {"v": WIRE_VERSION, "w": self.worker, "b": self.bases, "a": self.adapters, "f": self.in_flight,
                "bps": self.batches_per_s, "td": self.tasks_done, "pid": self.pid, "h": self.host,
                "ts": self.ts, "dr": self.draining}
        if self.service_rates:
            body["sr"] = self.service_rates
        if self.slots:
            body["su"], body["sn"], body["kv"] = self.slots_used, self.slots, self.kv_cache
        if self.precisions:
            body["pr"] = self.precisions
        return pack(body)

    @classmethod
    def from_wire(cls, data: bytes) -> Heartbeat:
        d = read_body(data, "heartbeat", _HEARTBEAT_SPEC)
        if not all(isinstance(b, str) for b in d["b"]):
            raise WireError("heartbeat field 'b' must be a list of strings")
        adapters = d["a"]
        if not all(isinstance(k, str) and isinstance(v, list) and all(isinstance(x, str) for x in v)
                   for k, v in adapters.items()):
            raise WireError("heartbeat field 'a' must map base names to lists of adapter ids")
        rates = d["sr"] or {}
        if not all(isinstance(k, str) and isinstance(v, NUMBER) and not isinstance(v, bool) and v >= 0
                   for k, v in rates.items()):
            raise WireError("heartbeat field 'sr' must map base names to non-negative numbers")
        used, slots, kv = (_counts(d[k] or {}, k) for k in ("su", "sn", "kv"))
        precisions = d["pr"] or {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in precisions.items()):
            raise WireError("heartbeat field 'pr' must map base names to precision names")
        return cls(worker=d["w"], bases=list(d["b"]), adapters={k: list(v) for k, v in adapters.items()},
                   in_flight=d["f"], batches_per_s=d["bps"], tasks_done=d["td"], pid=d["pid"], host=d["h"],
                   ts=d["ts"], draining=d["dr"], service_rates={k: float(v) for k, v in rates.items()},
                   slots_used={k: int(v) for k, v in used.items()}, slots={k: int(v) for k, v in slots.items()},
                   kv_cache={k: float(v) for k, v in kv.items()}, precisions=dict(precisions))


def _counts(d: dict[Any, Any], key: str) -> dict[str, float]:
    if not all(isinstance(k, str) and isinstance(v, NUMBER) and not isinstance(v, bool) and v >= 0
               for k, v in d.items()):
        raise WireError(f"heartbeat field {key!r} must map base names to non-negative numbers")
    return d


# The MessagePack HTTP route, POST /v1/encode/{model}:
#   request  {"inputs": [str, ...], "deadline_ms": int?}
#   response {"model": str, "dim": int, "vectors": [bytes(float32 × dim), ...], "prompt_tokens": int}
def encode_response(model: str, vectors: list[bytes], dim: int, prompt_tokens: int) -> bytes:
    return pack({"model": model, "dim": dim, "vectors": vectors, "prompt_tokens": prompt_tokens})
