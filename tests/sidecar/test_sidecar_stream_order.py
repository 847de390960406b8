"""Streamed chunks reach the gateway in order, check-ins included, through a real nats-server with the fleet's
credentials: a worker connection streams an engine's pieces (several arriving in one read, as an engine's
SSE stream delivers them) and a gateway-side subscriber answers receipts and feeds the gateway's TextStream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest

from lorafleet.core.wire import GENERATE, RECEIPT_CANCEL, GenerateParams, Result, Task
from lorafleet.nats.auth import gateway_inbox_prefix
from lorafleet.nats.server import NatsServer
from lorafleet.serve.textstream import TextStream
from lorafleet.sidecar import streaming
from lorafleet.sidecar.streaming import TextOut, TextStreams
from lorafleet.testing import flush_nats

PIECES = 24


@pytest.fixture
def auth_server(tmp_path: Path) -> Any:
    server = NatsServer(tmp_path / "nats", creds=tmp_path / "creds").start()
    try:
        yield server
    finally:
        server.stop()


def task(reply: str) -> Task:
    return Task(id="t1", request_id="r1", index=0, model="llm", base="llm", text="hi", tokens=2,
                deadline=time.time() + 30, reply=reply, op=GENERATE,
                params=GenerateParams(max_tokens=PIECES, temperature=0.0, stream=True).to_params())


async def engine_reads() -> AsyncIterator[list[str]]:
    """What one read of an engine's SSE stream gives: two pieces at once, reads a little apart."""
    for i in range(0, PIECES, 2):
        await asyncio.sleep(0.03)  # > CHECK_S below: the first piece of every read is a check-in
        yield [f"p{i} ", f"p{i + 1} "]


class Gateway:
    """The gateway's side of one request: receipts for check-ins, chunks into its TextStream, arrival order."""

    def __init__(self, nc: Any, receipt: bytes = b"") -> None:
        self.nc, self.receipt = nc, receipt
        self.stream = TextStream()
        self.seqs: list[int] = []
        self.final = asyncio.Event()

    async def on_msg(self, msg: Any) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, self.receipt)
        if not msg.data:
            return
        r = Result.from_wire(msg.data)
        if r.is_chunk:
            assert r.seq is not None
            self.seqs.append(r.seq)
            self.stream.chunk(r)
        else:
            self.stream.final(r)
            self.final.set()


async def connect(server: NatsServer, role: str) -> Any:
    return await nats.connect(server.url, **server.client_options(role))


async def stream_one(out: TextOut, streams: TextStreams, posted: bool) -> None:
    """Stream every piece as the engine lane does (`delta`, inline) or the batch runtime does (`post`)."""
    async for read in engine_reads():
        if posted:
            for piece in read:  # the main thread's deltas, several handled in one loop step
                out.post(piece)
        else:
            for piece in read:
                await out.delta(piece)
    chunks = await out.flushed()
    whole = "".join(f"p{i} " for i in range(PIECES))
    final = Result(out.task.id, 0, "w1", text=whole, prompt_tokens=2, completion_tokens=PIECES,
                   finish_reason="length", seq=chunks, attempt=1)
    await streams.nc.request(out.task.reply, final.to_wire(), timeout=5)


@pytest.mark.parametrize("posted", [False, True], ids=["engine-delta", "thread-post"])
async def test_chunks_reach_the_gateway_in_order_and_stream_whole(auth_server: NatsServer, posted: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming, "CHECK_S", 0.02)
    worker, gw_nc = await connect(auth_server, "worker"), await connect(auth_server, "gateway")
    try:
        inbox = gateway_inbox_prefix("gw1", auth_server.creds("gateway")) + ".r1"
        gw = Gateway(gw_nc)
        await gw_nc.subscribe(inbox, cb=gw.on_msg)
        await flush_nats(gw_nc)  # nats-py's single flush can overtake the buffered SUB
        streams = TextStreams(worker, "w1")
        out = streams.open(task(inbox), 1, stream=True)
        await stream_one(out, streams, posted)
        await asyncio.wait_for(gw.final.wait(), 5)
        assert gw.seqs == sorted(gw.seqs) and gw.seqs == list(range(len(gw.seqs))), gw.seqs
        assert not gw.stream.gap and not out.aborted
        deltas = []
        while not gw.stream.events.empty():
            deltas.append(gw.stream.events.get_nowait())
        texts = [e.text for e in deltas if e.kind == "delta"]
        assert "".join(texts) == "".join(f"p{i} " for i in range(PIECES))
        # every chunk went to the client as it came, none held back for the final result
        assert len(texts) == len(gw.seqs) == out.seq and deltas[-1].kind == "final"
        if not posted:
            assert len(texts) == PIECES
    finally:
        await worker.close()
        await gw_nc.close()


async def test_a_cancel_receipt_on_a_check_in_aborts_the_task(auth_server: NatsServer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Check-ins still ask: the gateway's `cancel` receipt stops the task, and so does nobody listening."""
    monkeypatch.setattr(streaming, "CHECK_S", 0.0)
    worker, gw_nc = await connect(auth_server, "worker"), await connect(auth_server, "gateway")
    try:
        inbox = gateway_inbox_prefix("gw1", auth_server.creds("gateway")) + ".r1"
        gw = Gateway(gw_nc, receipt=RECEIPT_CANCEL)
        await gw_nc.subscribe(inbox, cb=gw.on_msg)
        await flush_nats(gw_nc)  # nats-py's single flush can overtake the buffered SUB
        streams = TextStreams(worker, "w1")
        out = streams.open(task(inbox), 1, stream=True)
        aborted = asyncio.Event()
        out.on_abort(lambda reason: aborted.set())
        await out.delta("a")
        await asyncio.wait_for(aborted.wait(), 5)
        assert out.reason == streaming.CANCELLED
        gone = streams.open(task(inbox + "x"), 1, stream=True)  # nobody subscribes there
        gone_aborted = asyncio.Event()
        gone.on_abort(lambda reason: gone_aborted.set())
        await gone.delta("a")
        await asyncio.wait_for(gone_aborted.wait(), 5)
        assert gone.reason == streaming.CANCELLED
    finally:
        await worker.close()
        await gw_nc.close()
