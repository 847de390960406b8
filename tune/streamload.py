"""A lean streaming load generator for OpenAI-compatible generation: closed loop, server-sent events.

It shares the machine with what it measures (MEASURED.md), so, like loadgen.py, it speaks HTTP/1.1
keep-alive over raw asyncio streams and reads the chunked SSE body itself (no client library on the
hot path), and records its own CPU time. Per request it takes the time to the first text (TTFT),
the gaps between text events (inter-token latency: one event per engine step and sequence), the
output tokens the server reports (`stream_options.include_usage`) and the whole latency. The same
generator measures lorafleet's gateway and vLLM's own server, so both are timed the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from lorafleet.tune.loadgen import per_second, percentile, run_clients

BodyFor = Callable[[int], dict[str, Any]]


@dataclass
class StreamResult:
    level: float  # concurrency
    duration_s: float
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    gen_cpu_s: float = 0.0

    @property
    def requests(self) -> int:
        return len(self.latency_ms)

    @property
    def tokens_per_s(self) -> float:
        return per_second(self.output_tokens, self.duration_s)

    @staticmethod
    def _p(values: list[float], q: float) -> float | None:
        p = percentile(values, q)
        return None if p is None else round(p, 2)

    def summary(self) -> dict[str, Any]:
        return {"concurrency": self.level, "duration_s": round(self.duration_s, 2), "requests": self.requests,
                "errors": self.errors, "output_tokens": self.output_tokens,
                "output_tokens_per_s": round(self.tokens_per_s, 2),
                "ttft_p50_ms": self._p(self.ttft_ms, 50), "ttft_p99_ms": self._p(self.ttft_ms, 99),
                "itl_p50_ms": self._p(self.itl_ms, 50), "itl_p99_ms": self._p(self.itl_ms, 99),
                "latency_p50_ms": self._p(self.latency_ms, 50),
                "gen_cpu_pct": round(100.0 * per_second(self.gen_cpu_s, self.duration_s), 2)}


class StreamError(RuntimeError):
    pass


class SseConnection:
    """One keep-alive connection that POSTs JSON and reads a chunked `text/event-stream` answer."""

    def __init__(self, host: str, port: int, path: str, headers: dict[str, str] | None = None) -> None:
        self.host, self.port = host, port
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                      f"Accept: text/event-stream\r\n{extra}Content-Length: ").encode()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def stream(self, body: bytes, on_event: Callable[[bytes], None]) -> None:
        """Send one request; `on_event(data)` for each `data:` payload, as it arrives."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        assert self._reader is not None
        self._writer.write(self._head + str(len(body)).encode() + b"\r\n\r\n" + body)
        status = int((await self._reader.readline()).split(b" ", 2)[1])
        chunked, length, keep = False, 0, True
        while (line := await self._reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                keep = False
        if not chunked:
            body_bytes = await self._reader.readexactly(length)
            self.close()
            raise StreamError(f"HTTP {status}: {body_bytes[:300].decode(errors='replace')}")
        pending = b""
        while True:
            size = int((await self._reader.readline()).strip(), 16)
            if size == 0:
                await self._reader.readline()
                break
            pending += await self._reader.readexactly(size)
            await self._reader.readexactly(2)
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                if event.startswith(b"data: "):
                    on_event(event[6:])
        if not keep:
            self.close()
        if status != 200:
            raise StreamError(f"HTTP {status}")

    def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        self._reader = self._writer = None


async def stream_closed_loop(host: str, port: int, path: str, body_for: BodyFor, concurrency: int, duration_s: float,
                             headers: dict[str, str] | None = None) -> StreamResult:
    """`concurrency` clients, each streaming its next request as soon as the last one ended; requests begun
    before `duration_s` run to their end, and the duration counts until the last one ended."""
    result = StreamResult(concurrency, duration_s)

    async def client(end: float, counter: Iterator[int]) -> None:
        conn = SseConnection(host, port, path, headers)
        try:
            while time.perf_counter() < end:
                await _one(conn, body_for(next(counter)), result)
        finally:
            conn.close()

    result.duration_s, result.gen_cpu_s = await run_clients(client, concurrency, duration_s)
    return result


async def _one(conn: SseConnection, body: dict[str, Any], result: StreamResult) -> None:
    t0 = time.perf_counter()
    marks: list[float] = []
    state: dict[str, Any] = {"tokens": 0, "error": None}

    def on_event(data: bytes) -> None:
        if data == b"[DONE]":
            return
        obj = orjson.loads(data)
        if "error" in obj:
            state["error"] = str(obj["error"])[:300]
            return
        for choice in obj.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
            if text:
                marks.append(time.perf_counter())
        if obj.get("usage"):
            state["tokens"] = int(obj["usage"].get("completion_tokens", 0))

    try:
        await conn.stream(orjson.dumps(body), on_event)
    except Exception as exc:
        conn.close()
        _failed(result, f"{type(exc).__name__}: {exc}")
        return
    if state["error"] is not None or not marks:
        _failed(result, state["error"] or "no text in the stream")
        return
    result.latency_ms.append((time.perf_counter() - t0) * 1000.0)
    result.ttft_ms.append((marks[0] - t0) * 1000.0)
    result.itl_ms.extend((b - a) * 1000.0 for a, b in itertools.pairwise(marks))
    result.output_tokens += state["tokens"] or len(marks)


def _failed(result: StreamResult, why: str) -> None:
    result.errors += 1
    if len(result.error_samples) < 5:
        result.error_samples.append(why)
