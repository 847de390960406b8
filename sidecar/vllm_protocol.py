"""What `VllmEngine` speaks: its start settings (`EngineConfig`), requests, stream items, errors, wire format.

Pure logic (no I/O), so it is tested without vLLM installed.

Errors: EngineError
          ├─ EngineDied           the process exited (return code, log tail in the message)
          ├─ EngineStartTimeout   not ready within the timeout (the process is left to `stop()`)
          └─ EngineRequestError   the server refused a request (status, message); 404 = unknown
                                  model or adapter name, 400 = bad parameters
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "EngineDied",
    "EngineError",
    "EngineRequestError",
    "EngineStartTimeout",
    "Finished",
    "GenerateRequest",
    "StreamItem",
    "StreamState",
    "TextDelta",
    "error_message",
    "parse_metrics",
    "request_body",
]


class EngineError(RuntimeError):
    """The engine failed; the message says how."""


class EngineDied(EngineError):
    def __init__(self, message: str, *, returncode: int | None, log_tail: str) -> None:
        super().__init__(f"{message} (exit code {returncode})\n--- engine log tail ---\n{log_tail}")
        self.returncode = returncode
        self.log_tail = log_tail


class EngineStartTimeout(EngineError):
    pass


class EngineRequestError(EngineError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"engine answered {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class GenerateRequest:
    """One sequence. Exactly one of `prompt` (raw text) or `messages` (chat; the engine applies the
    model's chat template). `extra` goes to vLLM as is (e.g. ignore_eos, min_tokens)."""

    prompt: str | None = None
    messages: Sequence[Mapping[str, str]] | None = None
    adapter: str | None = None  # a loaded adapter's name; None = the base model
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: Sequence[str] = ()
    seed: int | None = None
    request_id: str | None = None  # X-Request-Id: shows in vLLM's log ("Request cmpl-<id>-0 aborted.")
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("GenerateRequest needs exactly one of prompt or messages")


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length" | ...
    prompt_tokens: int
    completion_tokens: int


StreamItem = TextDelta | Finished


def request_body(req: GenerateRequest, base_model: str) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of a streamed completion: /v1/chat/completions for messages, else /v1/completions."""
    body: dict[str, Any] = {
        "model": req.adapter or base_model, "max_tokens": req.max_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "stream": True, "stream_options": {"include_usage": True},
    }
    if req.stop:
        body["stop"] = list(req.stop)
    if req.seed is not None:
        body["seed"] = req.seed
    body.update(req.extra)
    if req.messages is not None:
        body["messages"] = [dict(m) for m in req.messages]
        return "/v1/chat/completions", body
    body["prompt"] = req.prompt
    return "/v1/completions", body


class StreamState:
    """Turns server-sent-event lines into stream items; `finished()` once the stream has ended."""

    def __init__(self) -> None:
        self.done = False
        self.finish_reason: str | None = None
        self.usage: dict[str, int] = {}

    def feed(self, line: str) -> list[TextDelta]:
        if not line.startswith("data: "):
            return []
        data = line[6:]
        if data == "[DONE]":
            self.done = True
            return []
        chunk = json.loads(data)
        if "error" in chunk:  # vLLM reports failures that happen after the headers inside the stream
            err = chunk["error"]
            status = err.get("code") if isinstance(err, dict) else None
            raise EngineRequestError(int(status) if isinstance(status, int) else 500, error_message(data))
        out: list[TextDelta] = []
        for choice in chunk.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
            if text:
                out.append(TextDelta(text))
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.usage = chunk.get("usage") or self.usage
        return out

    def finished(self) -> Finished | None:
        if self.finish_reason is None:
            return None
        return Finished(self.finish_reason, int(self.usage.get("prompt_tokens", 0)),
                        int(self.usage.get("completion_tokens", 0)))


def error_message(text: str) -> str:
    """The message of an OpenAI-style error body (`{"error": {"message": ...}}`), else the text."""
    try:
        err = json.loads(text)
    except ValueError:
        return text[:2000]
    if isinstance(err, dict):
        err = err.get("error", err)
        if isinstance(err, dict):
            err = err.get("message", err)
    return str(err)[:2000]


_METRICS = {
    "vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage", "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:generation_tokens_total": "generation_tokens_total", "vllm:num_preemptions_total": "preemptions_total",
}


def parse_metrics(text: str) -> dict[str, float]:
    """Flat gauges and counters from vLLM's Prometheus text, summed over label sets: running,
    waiting, kv_cache_usage (0..1), *_tokens_total, preemptions_total, requests_<finish reason>_total.
    vllm 0.32 counts no aborts: a cancelled request shows in none of them."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(_METRICS.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _METRICS:
                out[_METRICS[sample.name]] += sample.value
            elif sample.name == "vllm:request_success_total":
                key = f"requests_{sample.labels.get('finished_reason', 'unknown')}_total"
                out[key] = out.get(key, 0.0) + sample.value
    return out


@dataclass(frozen=True)
class EngineConfig:
    """How to start the engine. `model` is a local directory (nothing is downloaded)."""

    model: str
    served_name: str = "base"
    venv: Path | None = None  # default: the verified venv of vllm_install
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    enable_lora: bool = True
    max_loras: int = 4  # adapters in one batch
    max_cpu_loras: int | None = None  # adapters cached in host memory (vLLM default: max_loras)
    max_lora_rank: int = 16
    kv_cache_gib: int = 1  # CPU: VLLM_CPU_KVCACHE_SPACE; CUDA: --kv-cache-memory-bytes when set
    gpu_memory_utilization: float = 0.85  # CUDA, when kv_cache_gib is 0
    omp_threads_bind: str | None = None  # CPU: VLLM_CPU_OMP_THREADS_BIND ("auto", "nobind", "0-1")
    log_requests: bool = False  # --enable-log-requests: one line per request, "Request <id> aborted." on cancel
    enforce_eager: bool = False
    seed: int = 0
    transport: Literal["uds", "tcp"] = "uds"
    log_path: Path | None = None  # default: engine.log in the private run dir (removed at stop)
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
