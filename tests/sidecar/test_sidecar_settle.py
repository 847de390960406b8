"""Settling without a worker process: one reply path with receipt for every result, then the ack table.

The fakes record what the Settler does to a JetStream message and to the connection; they stand in
for NATS only to test this pure decision logic (the integration tests run it on a real server).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from nats.errors import NoRespondersError

from lorafleet.core.config import QueueConfig
from lorafleet.core.wire import ERR_ADAPTER, ERR_DEADLINE, Result, Task
from lorafleet.sidecar.acks import Situation, decide
from lorafleet.sidecar.owners import Owner, OwnerTracker
from lorafleet.sidecar.settle import HeldTable, Settlement, Settler, after_reply, reply_hint


class FakeMsg:
    def __init__(self, task: Task | None, delivered: int = 1, data: bytes | None = None) -> None:
        self.data = data if data is not None else task.to_wire()  # type: ignore[union-attr]
        self.subject = "lorafleet.work.b"
        self.headers = {"Nats-Msg-Id": task.id} if task else None
        self.metadata = SimpleNamespace(num_delivered=delivered)
        self.settled: list[tuple[str, Any]] = []

    async def ack(self) -> None:
        self.settled.append(("ack", None))

    async def nak(self, delay: float | None = None) -> None:
        self.settled.append(("nak", delay))

    async def term(self) -> None:
        self.settled.append(("term", None))


class FakeNats:
    """`request` succeeds (a receipt) unless the inbox is in `gone`; `gate` can hold replies until released."""

    def __init__(self, gone: set[str] = frozenset(), gate: asyncio.Event | None = None) -> None:  # type: ignore[assignment]
        self.gone, self.gate = gone, gate
        self.sent: list[tuple[str, Result]] = []
        self.waiting = 0

    async def request(self, subject: str, body: bytes, timeout: float) -> None:
        self.sent.append((subject, Result.from_wire(body)))
        if self.gate is not None:
            self.waiting += 1
            await asyncio.wait_for(self.gate.wait(), 2.0)
        if subject in self.gone:
            raise TimeoutError("no receipt")


class FakeJs:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.dead: list[dict[str, str]] = []

    async def publish(self, subject: str, data: bytes, headers: dict[str, str], stream: str) -> None:
        if self.fail:
            raise ConnectionError("stream unavailable")
        self.dead.append(headers)


def task(i: int = 0, reply: str = "_INBOX.gw.r") -> Task:
    return Task(id=f"r.{i}", request_id="r", index=i, model="m", base="b", text="x", tokens=3, deadline=1e12,
                reply=reply, enqueued=0.0)


def settler(nc: FakeNats, js: FakeJs | None = None, max_deliver: int = 3) -> tuple[Settler, HeldTable]:
    held = HeldTable()
    return Settler(nc, js or FakeJs(), QueueConfig(max_deliver=max_deliver, nak_delay_s=0.5), "w1", held,
                   {"b": 2}), held


async def test_a_confirmed_result_is_acked_and_carries_the_vector() -> None:
    nc = FakeNats()
    s, held = settler(nc)
    msg = FakeMsg(task())
    held.add(msg)
    await s.settle(msg, "b", Situation.OK, task=task(), vector=b"\x00" * 8)
    assert msg.settled == [("ack", None)] and len(held) == 0 and s.tasks_done == 1
    (subject, result), = nc.sent
    assert subject == "_INBOX.gw.r" and result.vector == b"\x00" * 8 and result.dim == 2 and result.ok


@pytest.mark.parametrize(("situation", "code"), [(Situation.ADAPTER_UNAVAILABLE, ERR_ADAPTER),
                                                  (Situation.OK, None)])
async def test_an_unconfirmed_reply_keeps_the_task_for_another_delivery(situation: Situation, code: str | None
                                                                        ) -> None:
    # An error sent while the gateway reconnects used to be lost: now it goes the same way as a result.
    nc = FakeNats(gone={"_INBOX.gw.r"})
    s, _ = settler(nc)
    msg = FakeMsg(task(), delivered=1)
    await s.settle(msg, "b", situation, task=task(), vector=b"\x00" * 8 if code is None else None)
    assert nc.sent[0][1].error_code == code
    assert msg.settled == [("nak", 0.5)] and s.tasks_done == 0


async def test_on_the_last_delivery_an_unconfirmed_reply_is_dead_lettered() -> None:
    nc, js = FakeNats(gone={"_INBOX.gw.r"}), FakeJs()
    s, _ = settler(nc, js, max_deliver=2)
    msg = FakeMsg(task(), delivered=2)
    await s.settle(msg, "b", Situation.OK, task=task(), vector=b"\x00" * 8)
    assert msg.settled == [("term", None)]
    assert "no gateway confirmed the reply on the last delivery" in js.dead[0]["Lorafleet-Dlq-Reason"]


async def test_a_passed_deadline_is_acked_even_when_nobody_confirms() -> None:
    nc = FakeNats(gone={"_INBOX.gw.r"})
    s, _ = settler(nc)
    msg = FakeMsg(task())
    await s.settle(msg, "b", Situation.DEADLINE, task=task(), reason="deadline passed in the queue")
    assert nc.sent[0][1].error_code == ERR_DEADLINE and msg.settled == [("ack", None)]


async def test_a_malformed_task_is_answered_from_what_can_be_read_and_dead_lettered() -> None:
    raw = task(3).to_wire().replace(b"\xa1t", b"\xa1T")  # rename field 't': no longer a Task
    assert reply_hint(raw) == ("_INBOX.gw.r", "r.3", 3)
    nc, js = FakeNats(), FakeJs()
    s, _ = settler(nc, js)
    msg = FakeMsg(None, data=raw)
    await s.settle(msg, "b", Situation.MALFORMED, reason="task is missing field 't'")
    (subject, result), = nc.sent
    assert subject == "_INBOX.gw.r" and result.index == 3 and result.error_code == "malformed_task"
    assert msg.settled == [("term", None)] and js.dead


async def test_a_failed_dead_letter_keeps_the_task() -> None:
    s, _ = settler(FakeNats(), FakeJs(fail=True))
    msg = FakeMsg(task())
    await s.settle(msg, "b", Situation.ADAPTER_UNAVAILABLE, task=task(), reason="no such adapter")
    assert msg.settled == [("nak", None)]


async def test_replies_of_one_batch_go_out_together() -> None:
    # Both replies must be in flight before either is confirmed: one gone gateway must not serialise a batch.
    gate = asyncio.Event()
    nc = FakeNats(gate=gate)
    s, _ = settler(nc)
    msgs = [FakeMsg(task(i)) for i in range(2)]
    settling = asyncio.create_task(s.settle_many([Settlement(m, "b", Situation.OK, task(i), payload=b"\x00" * 8)
                                                  for i, m in enumerate(msgs)]))
    while nc.waiting < 2:
        await asyncio.sleep(0)
        assert not settling.done()
    gate.set()
    await settling
    assert [m.settled for m in msgs] == [[("ack", None)], [("ack", None)]]


async def test_drain_awaits_the_last_settle() -> None:
    held = HeldTable()
    assert await held.wait_empty(0.01)
    msg = FakeMsg(task())
    held.add(msg)
    assert not await held.wait_empty(0.01)
    asyncio.get_running_loop().call_soon(held.discard, msg)
    assert await held.wait_empty(1.0)


def test_after_reply_rules() -> None:
    ok = decide(Situation.OK, 1, 3)
    assert after_reply(ok, Situation.OK, True, False) == (ok, None)
    changed, why = after_reply(ok, Situation.OK, False, False)
    assert changed.settle.value == "nak" and changed.nak_delay and why == "no gateway confirmed the reply"
    shutdown = decide(Situation.SHUTDOWN, 1, 3)  # no reply at all: nothing to confirm
    assert after_reply(shutdown, Situation.SHUTDOWN, False, False) == (shutdown, None)


class AwayNats:
    """`request` finds nobody on any inbox (a gateway reconnecting): no responders, for results and probes alike."""

    def __init__(self) -> None:
        self.requests = 0

    async def request(self, subject: str, body: bytes, timeout: float) -> None:
        self.requests += 1
        raise NoRespondersError


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize(("max_deliver", "nak_delay_s"), [(5, 0.5), (3, 0.1), (2, 0.5), (8, 0.0)])
async def test_an_away_owner_keeps_its_task_until_the_grace_has_passed(max_deliver: int, nak_delay_s: float) -> None:
    # Issue 23 item 4: each retry of an away owner's task uses a delivery; 0.5 s apart, 5 deliveries ended 2 s after
    # the inbox vanished, before a 3 s grace, and the task was dropped although its gateway was only reconnecting.
    clock, nc = Clock(), AwayNats()
    owners = OwnerTracker(nc.request, grace_s=3.0, clock=clock)
    s = Settler(nc, FakeJs(), QueueConfig(max_deliver=max_deliver, nak_delay_s=nak_delay_s), "w1", HeldTable(),
                {"b": 2}, owners=owners)
    t = task()
    msg = FakeMsg(t, delivered=1)
    await s.settle(msg, "b", Situation.OK, task=t, vector=b"\x00" * 8)  # computed; the reply finds nobody
    vanished = clock.t
    for delivered in range(2, max_deliver + 1):
        (kind, delay), = msg.settled
        assert kind == "nak" and delay is not None and delay >= nak_delay_s
        clock.t += delay
        if delivered == max_deliver:
            break
        assert await owners.status(t.reply) is Owner.AWAY  # what intake sees on this delivery: retried, not computed
        msg = FakeMsg(t, delivered=delivered)
        await s.settle(msg, "b", Situation.OWNER_AWAY, task=t)
    # The last delivery comes only once the grace has passed since the inbox vanished: a gateway back by then gets
    # its answer, one still away is gone (dropped uncomputed, not dropped while merely reconnecting).
    assert clock.t - vanished >= owners.grace_s
    assert await owners.status(t.reply) is Owner.GONE


async def test_each_task_is_decided_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafleet.sidecar import settle as settle_module

    calls: list[Situation] = []

    def counting(situation: Situation, delivered: int | None, max_deliver: int) -> Any:
        calls.append(situation)
        return decide(situation, delivered, max_deliver)

    monkeypatch.setattr(settle_module, "decide", counting)
    s, _ = settler(FakeNats())
    msgs = [FakeMsg(task(i)) for i in range(3)]
    await s.settle_many([Settlement(m, "b", Situation.OK, task(i), payload=b"\x00" * 8) for i, m in enumerate(msgs)])
    assert calls == [Situation.OK] * 3 and all(m.settled == [("ack", None)] for m in msgs)
