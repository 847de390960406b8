"""Who still waits for a task (owners.py), the service rate a worker reports, and admit's drop of orphans."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from nats.errors import NoRespondersError
from sidecar_testkit import BASE, fleet_dict, until

from lorafleet.core.config import FleetConfig, QueueConfig
from lorafleet.core.wire import HDR_MSG_ID, Result, Task, consumer_name, inbox_prefix, work_subject
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.owners import Owner, OwnerTracker, owner_of
from lorafleet.sidecar.scheduler import PullScheduler
from lorafleet.sidecar.service_rate import ServiceRate
from lorafleet.sidecar.settle import HeldTable, Settlement


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Inboxes:
    """A fake `nc.request`: gateways listed in `present` confirm, the others have no responders."""

    def __init__(self) -> None:
        self.present: set[str] = set()
        self.calls: list[str] = []

    async def request(self, subject: str, body: bytes, timeout: float) -> Any:
        self.calls.append(subject)
        await asyncio.sleep(0)
        if owner_of(subject) not in self.present:
            raise NoRespondersError
        return object()


async def test_an_owner_is_away_first_and_gone_after_the_grace() -> None:
    clock, inboxes = Clock(), Inboxes()
    owners = OwnerTracker(inboxes.request, grace_s=3.0, clock=clock)
    reply = "_INBOX.UKEY.gw-1.req-9"
    assert owner_of(reply) == "_INBOX.UKEY.gw-1"
    assert not owners.suspect(reply)
    inboxes.present.add("_INBOX.UKEY.gw-1")
    assert await owners.status(reply) is Owner.ALIVE
    inboxes.present.clear()  # the gateway died (or is reconnecting)
    owners.heard(reply, False)  # a reply found no responders
    assert owners.suspect(reply)
    assert await owners.status(reply) is Owner.AWAY  # within the grace: maybe a reconnect
    clock.t += 3.5
    assert await owners.status("_INBOX.UKEY.gw-1.other-request") is Owner.GONE  # same gateway, any request
    inboxes.present.add("_INBOX.UKEY.gw-1")  # it came back after all: any answer clears it
    clock.t += 1.0
    assert await owners.status(reply) is Owner.ALIVE and not owners.suspect(reply)


async def test_probes_are_shared_and_cached() -> None:
    clock, inboxes = Clock(), Inboxes()
    owners = OwnerTracker(inboxes.request, grace_s=0.0, clock=clock)
    replies = [f"_INBOX.gw-dead.req-{i}" for i in range(20)]
    verdicts = await asyncio.gather(*(owners.status(r) for r in replies))
    assert set(verdicts) == {Owner.GONE} and len(inboxes.calls) == 1  # one probe for one gateway
    await owners.status(replies[0])
    assert len(inboxes.calls) == 1  # cached for PROBE_TTL_S
    clock.t += 1.0
    await owners.status(replies[0])
    assert len(inboxes.calls) == 2


async def test_an_inconclusive_probe_never_drops_anything() -> None:
    async def timeout(subject: str, body: bytes, timeout: float) -> Any:
        raise TimeoutError

    owners = OwnerTracker(timeout, grace_s=0.0)
    assert await owners.status("_INBOX.gw.req") is Owner.ALIVE


def test_service_rate_counts_busy_time_only() -> None:
    clock = Clock()
    rate = ServiceRate(window_s=1e9, clock=clock)  # no decay: exact arithmetic
    assert rate.per_s() is None
    rate.begin()
    clock.t += 3.0
    rate.end(8)  # the first batch warms up (3 s for 8 tasks): left out
    assert rate.per_s() is None
    rate.begin()
    clock.t += 0.1
    rate.end(10)  # 10 tasks in 0.1 s busy
    clock.t += 5.0  # idle: does not dilute the rate
    assert rate.per_s() == pytest.approx(100.0)
    rate.begin()
    clock.t += 0.05
    rate.begin()  # a second batch while the first runs (pipelining): busy time is counted once
    clock.t += 0.05
    rate.end(5)
    clock.t += 0.1
    rate.end(5)
    assert rate.per_s() == pytest.approx(20 / 0.3)


def test_service_rate_decays_with_its_window() -> None:
    clock = Clock()
    rate = ServiceRate(window_s=1.0, clock=clock)
    for _ in range(50):  # slow batches long ago
        rate.begin()
        clock.t += 0.1
        rate.end(1)
    for _ in range(500):  # fast batches for the last five seconds
        rate.begin()
        clock.t += 0.01
        rate.end(1)
    assert rate.per_s() == pytest.approx(100.0, rel=0.05)


class Msg:
    def __init__(self, task: Task, delivered: int) -> None:
        self.data = task.to_wire()
        self.metadata = type("Meta", (), {"num_delivered": delivered, "num_pending": 0})()


class Settler:
    def __init__(self) -> None:
        self.settled: list[tuple[Situation, str]] = []
        self.queue = FleetConfig().queue

    async def settle_many(self, items: list[Settlement]) -> None:
        self.settled += [(item.situation, item.task.id if item.task else "?") for item in items]


async def test_admit_drops_orphans_before_compute_and_probes_only_when_it_matters() -> None:
    clock, inboxes = Clock(), Inboxes()
    inboxes.present.add("_INBOX.live")
    owners = OwnerTracker(inboxes.request, grace_s=2.0, clock=clock)
    settler = Settler()
    sched = PullScheduler(FleetConfig.model_validate({"bases": [{"name": "b"}]}), {"b": None}, HeldTable(),
                          settler, lambda batch: None, lambda b, a: FleetConfig().worker.profile,
                          asyncio.Semaphore(1), lambda: False, owners=owners)

    def task(i: int, inbox: str) -> Task:
        return Task(id=f"t{i}", request_id="r", index=0, model="b", base="b", text="x", tokens=3,
                    deadline=time.time() + 30, reply=f"{inbox}.r{i}")

    # First deliveries of an unknown gateway: no probe at all (the common case costs nothing).
    pulled = await sched.admit("b", [Msg(task(1, "_INBOX.live"), 1), Msg(task(2, "_INBOX.dead"), 1)])
    assert [p.task.id for p in pulled] == ["t1", "t2"] and inboxes.calls == []
    # A redelivery is checked; a gateway just seen absent is away (retried later, not computed) ...
    owners.heard("_INBOX.dead.r2", False)
    pulled = await sched.admit("b", [Msg(task(3, "_INBOX.live"), 2), Msg(task(4, "_INBOX.dead"), 1)])
    assert [p.task.id for p in pulled] == ["t3"]
    assert settler.settled == [(Situation.OWNER_AWAY, "t4")]
    # ... and gone once absent past the grace: dropped.
    clock.t += 2.5
    pulled = await sched.admit("b", [Msg(task(5, "_INBOX.dead"), 3)])
    assert pulled == [] and settler.settled[-1] == (Situation.ORPHANED, "t5") and owners.dropped == 1


@pytest.mark.integration
def test_an_answer_rides_out_a_gateway_reconnect(nats_server: Any, start_worker: Any, tiny_model_dir: Path,
                                                 tiny_adapters: dict[str, Path]) -> None:
    # Issue 23 item 4: a task whose gateway was reconnecting was retried every nak_delay_s, each retry a delivery,
    # and dropped unanswered at its last delivery, long before orphan_grace_s had passed.
    grace = 3.0
    fleet = fleet_dict(tiny_model_dir, tiny_adapters, orphan_grace_s=grace)  # max_deliver 3, nak_delay_s 0.1
    # Backoff steps all equal to ack_wait: nats-server then redelivers a nak'ed task after exactly its nak delay. (With
    # growing steps, as derived by default, it adds backoff[n] - ack_wait to the n-th nak's delay on 2.15.)
    fleet["queue"]["backoff_s"] = [fleet["queue"]["ack_wait_s"]] * 2
    start_worker(fleet, nats_server.url, "reconnect")
    result = asyncio.run(reconnecting_gateway(nats_server.url, grace))
    assert result.ok and result.vector and result.dim > 0


async def reconnecting_gateway(url: str, grace: float) -> Result:
    """A gateway whose inbox is gone while its task is computed, and back after 0.8 of the grace: its answer."""
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()
    prefix = inbox_prefix("gw-reconnect")
    task = Task(id=uuid.uuid4().hex, request_id="rq", index=0, model=BASE, base=BASE, text="Die Kündigung.",
                tokens=4, deadline=time.time() + 60, reply=f"{prefix}.rq")
    answered: asyncio.Future[Result] = asyncio.get_running_loop().create_future()

    async def gateway(msg: Any) -> None:  # confirms results and probes alike, as the gateway does
        if msg.reply:
            await nc.publish(msg.reply, b"")
        if msg.data and not answered.done():
            answered.set_result(Result.from_wire(msg.data))

    async def delivered_again() -> bool:
        info = await js.consumer_info(QueueConfig().stream, consumer_name(BASE))
        return info.delivered.consumer_seq >= 2

    try:
        away = time.monotonic()  # nobody subscribes to the inbox: the gateway is reconnecting
        await js.publish(work_subject(BASE), task.to_wire(), headers={HDR_MSG_ID: task.id})
        # The worker computed it, found nobody on the inbox and gave it back: it came again (a known state).
        await until(delivered_again, grace * 0.8, "the task was redelivered while its inbox was away")
        await asyncio.sleep(max(away + grace * 0.8 - time.monotonic(), 0.0))  # the reconnect takes 0.8 of the grace
        await nc.subscribe(f"{prefix}.>", cb=gateway)
        try:
            return await asyncio.wait_for(answered, grace + 10.0)
        except TimeoutError:
            raise AssertionError("no answer: the task was dropped while its gateway reconnected") from None
    finally:
        await nc.close()
