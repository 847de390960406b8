"""The load generator against a real (minimal) HTTP/1.1 keep-alive server with a fixed service time."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.tune.loadgen import Target, closed_loop, open_loop, poisson_schedule

SERVICE_S = 0.02


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            body = await reader.readexactly(length)
            await asyncio.sleep(SERVICE_S)
            status = b"200 OK" if body != b"fail" else b"500 Internal Server Error"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _with_server(fn):  # type: ignore[no-untyped-def]
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await fn(port)
    finally:
        server.close()
        await server.wait_closed()


def test_closed_loop_throughput_follows_concurrency() -> None:
    async def run(port: int):  # type: ignore[no-untyped-def]
        target = Target("127.0.0.1", port, "/x", lambda i: b"hello")
        return await closed_loop(target, 1, 0.6), await closed_loop(target, 4, 0.6)

    one, four = asyncio.run(_with_server(run))
    assert one.errors == 0 and four.errors == 0
    assert one.percentile(50) >= SERVICE_S * 1000
    # Four concurrent clients against a server that overlaps requests: ~4× the rate of one.
    assert 2.5 < four.throughput / one.throughput < 5.0
    assert one.throughput < 1 / SERVICE_S * 1.05


def test_open_loop_counts_offered_load_and_errors() -> None:
    async def run(port: int):  # type: ignore[no-untyped-def]
        target = Target("127.0.0.1", port, "/x", lambda i: b"fail" if i % 10 == 0 else b"hello")
        return await open_loop(target, rate=100.0, duration_s=1.0, seed=1)

    res = asyncio.run(_with_server(run))
    sent = len(poisson_schedule(100.0, 1.0, 1))
    assert res.ok + res.errors == sent
    assert res.errors == sum(1 for i in range(sent) if i % 10 == 0)
    assert res.statuses[500] == res.errors
    assert res.percentile(50) >= SERVICE_S * 1000
    assert res.gen_cpu_pct < 60  # the generator must stay light (it is measured, not assumed)


def test_poisson_schedule_rate() -> None:
    times = poisson_schedule(200.0, 20.0, seed=3)
    assert times == sorted(times) and times[-1] < 20.0
    assert len(times) / 20.0 == pytest.approx(200.0, rel=0.05)
    with pytest.raises(ValueError):
        poisson_schedule(0.0, 1.0, 0)
