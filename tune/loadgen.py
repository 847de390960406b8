"""A lean HTTP load generator: closed loop at a fixed concurrency, and open-loop Poisson arrivals.

It shares two cores with the server it measures (MEASURED.md), so it speaks HTTP/1.1 keep-alive
over raw asyncio streams (no client library on the hot path) and records its own CPU time, which
the sweep reports next to every figure.

Open loop: send times are drawn up front from an exponential distribution (Poisson arrivals), and
each latency is measured from the *intended* send time, so a server that stalls the sender is
charged for the stall (no coordinated omission).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

BodyFor = Callable[[int], bytes]


@dataclass
class LoadResult:
    mode: str  # "closed" or "open"
    level: float  # concurrency (closed) or offered rate in requests/s (open)
    duration_s: float
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    unsent: int = 0  # open loop: every connection busy, so the generator could not send on time
    statuses: dict[int, int] = field(default_factory=dict)
    gen_cpu_s: float = 0.0

    @property
    def ok(self) -> int:
        return len(self.latencies_ms)

    @property
    def throughput(self) -> float:
        return per_second(self.ok, self.duration_s)

    def percentile(self, q: float) -> float | None:
        return percentile(self.latencies_ms, q)

    @property
    def gen_cpu_pct(self) -> float:
        return 100.0 * per_second(self.gen_cpu_s, self.duration_s)

    def summary(self) -> dict[str, float | int | str | None]:
        return {"mode": self.mode, "level": self.level, "duration_s": round(self.duration_s, 3),
                "requests": self.ok, "errors": self.errors, "unsent": self.unsent,
                "throughput_rps": round(self.throughput, 2),
                "p50_ms": _r(self.percentile(50)), "p90_ms": _r(self.percentile(90)),
                "p99_ms": _r(self.percentile(99)), "gen_cpu_pct": round(self.gen_cpu_pct, 2)}


def per_second(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


class HttpError(RuntimeError):
    pass


class Connection:
    """One keep-alive HTTP/1.1 connection that POSTs bodies and reads Content-Length responses."""

    def __init__(self, host: str, port: int, path: str, content_type: str) -> None:
        self.host, self.port = host, port
        self._head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"
                      "Content-Length: ").encode()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _open(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)

    async def post(self, body: bytes) -> int:
        """Status code of one POST; reconnects once if the server closed the idle connection."""
        for attempt in range(2):
            if self._writer is None:
                await self._open()
            try:
                return await self._exchange(body)
            except (ConnectionError, asyncio.IncompleteReadError, HttpError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _exchange(self, body: bytes) -> int:
        assert self._reader is not None and self._writer is not None
        self._writer.write(self._head + str(len(body)).encode() + b"\r\n\r\n" + body)
        line = await self._reader.readline()
        if not line:
            raise HttpError("connection closed")
        status = int(line.split(b" ", 2)[1])
        length = 0
        keep = True
        while True:
            header = await self._reader.readline()
            if header in (b"\r\n", b""):
                break
            name, _, value = header.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                keep = False
            elif name == b"transfer-encoding":
                raise HttpError("chunked responses are not supported by the load generator")
        if length:
            await self._reader.readexactly(length)
        if not keep:
            self.close()
        return status

    def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        self._reader = self._writer = None


class Target:
    """Where the load goes: host, port, path and content type of the POST, and a body per request number."""

    def __init__(self, host: str, port: int, path: str, body_for: BodyFor,
                 content_type: str = "application/msgpack") -> None:
        self.host, self.port, self.path, self.body_for, self.content_type = host, port, path, body_for, content_type

    def connection(self) -> Connection:
        return Connection(self.host, self.port, self.path, self.content_type)


async def run_clients(client: Callable[[float, Iterator[int]], Awaitable[None]], concurrency: int,
                      duration_s: float) -> tuple[float, float]:
    """`concurrency` copies of `client(end, counter)` (end: perf_counter time to stop starting requests; counter:
    the request numbers they share); (wall seconds until the last one returned, this process's CPU seconds).
    The closed loops of both generators (this one and streamload.py) run on it."""
    counter = iter(range(10**12))
    cpu0 = time.process_time()
    start = time.perf_counter()
    await asyncio.gather(*(client(start + duration_s, counter) for _ in range(concurrency)))
    return time.perf_counter() - start, time.process_time() - cpu0


async def closed_loop(target: Target, concurrency: int, duration_s: float) -> LoadResult:
    """`concurrency` clients, each sending its next request as soon as the last one is answered."""
    result = LoadResult("closed", concurrency, duration_s)

    async def client(end: float, counter: Iterator[int]) -> None:
        conn = target.connection()
        try:
            while True:
                t0 = time.perf_counter()
                if t0 >= end:
                    return
                await _one(conn, target.body_for(next(counter)), t0, result)
        finally:
            conn.close()

    result.duration_s, result.gen_cpu_s = await run_clients(client, concurrency, duration_s)
    return result


async def _one(conn: Connection, body: bytes, t_ref: float, result: LoadResult) -> None:
    try:
        status = await conn.post(body)
    except Exception:
        result.errors += 1
        return
    result.statuses[status] = result.statuses.get(status, 0) + 1
    if status == 200:
        result.latencies_ms.append((time.perf_counter() - t_ref) * 1000.0)
    else:
        result.errors += 1


def poisson_schedule(rate: float, duration_s: float, seed: int) -> list[float]:
    """Send offsets (seconds from start) of a Poisson process with `rate` arrivals per second."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def open_loop(target: Target, rate: float, duration_s: float, seed: int = 0,
                    max_connections: int = 256, drain_s: float = 30.0) -> LoadResult:
    """Poisson arrivals at `rate`/s for `duration_s`; latency from each request's intended send time.

    Requests never wait for each other: each goes out on a free keep-alive connection, opening a
    new one when all are busy (up to `max_connections`; beyond that the request is counted as
    `unsent`: the server fell so far behind that the offered load was not sustained, and an
    overloaded client would be measuring itself). Stragglers get `drain_s`, then count as unsent too.
    """
    result = LoadResult("open", rate, duration_s)
    schedule = poisson_schedule(rate, duration_s, seed)
    idle: list[Connection] = []
    opened = 0
    cpu0 = time.process_time()
    start = time.perf_counter()

    async def send(i: int, intended: float) -> None:
        nonlocal opened
        if idle:
            conn = idle.pop()
        elif opened < max_connections:
            opened += 1
            conn = target.connection()
        else:
            result.unsent += 1
            return
        await _one(conn, target.body_for(i), intended, result)
        idle.append(conn)

    result.unsent += await _run_schedule(schedule, start, send, drain_s)
    result.duration_s = max(time.perf_counter() - start, duration_s)
    result.gen_cpu_s = time.process_time() - cpu0
    for conn in idle:
        conn.close()
    return result


async def open_loop_calls(call: Callable[[int], Awaitable[bool]], schedule: list[float], *, level: float,
                          duration_s: float, drain_s: float = 30.0) -> LoadResult:
    """Open loop over any async call, not only HTTP: `call(i)` starts at `schedule[i]` seconds from now.

    Same accounting as `open_loop`: latency runs from the *intended* send time to the call's
    return, `call` returns True on success (False or an exception counts as an error), and calls
    still running `drain_s` after the last send count as errors. `schedule` may come from
    `poisson_schedule` or any other arrival process (bursts); `level` is what the result reports.
    """
    result = LoadResult("open", level, duration_s)
    cpu0 = time.process_time()
    start = time.perf_counter()

    async def one(i: int, intended: float) -> None:
        try:
            ok = await call(i)
        except Exception:
            ok = False
        if ok:
            result.latencies_ms.append((time.perf_counter() - intended) * 1000.0)
        else:
            result.errors += 1

    result.errors += await _run_schedule(schedule, start, one, drain_s)
    result.duration_s = max(time.perf_counter() - start, duration_s)
    result.gen_cpu_s = time.process_time() - cpu0
    return result


async def _run_schedule(schedule: list[float], start: float, launch: Callable[[int, float], Awaitable[None]],
                        drain_s: float) -> int:
    """Start `launch(i, intended)` at each intended time (never waiting on earlier ones, so there is
    no coordinated omission); wait up to `drain_s` for the stragglers; return how many were cut off."""
    tasks: set[asyncio.Task[None]] = set()
    for i, offset in enumerate(schedule):
        intended = start + offset
        delay = intended - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(launch(i, intended))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if not tasks:
        return 0
    _, pending = await asyncio.wait(set(tasks), timeout=drain_s)
    for task in pending:
        task.cancel()
    return len(pending)
