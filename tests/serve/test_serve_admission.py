"""Admission control and what it is fed: the rule, the workers' summed service rate, the backlog count."""

from __future__ import annotations

import pytest

from lorafleet.core import wire
from lorafleet.serve.admission import MAX_RETRY_AFTER_S, judge
from lorafleet.serve.pending import PendingTable
from lorafleet.serve.workers import WorkerRegistry


def test_idle_unknown_or_disabled_admits() -> None:
    assert judge(0, 1000, 10.0, 0.001, 0.5) is None  # an idle queue: the deadline is the client's choice
    assert judge(5000, 1, None, 1.0, 0.5) is None  # no worker has measured its rate yet
    assert judge(5000, 1, 10.0, 1.0, None) is None  # admission control off


def test_refuses_what_the_rate_cannot_finish_within_the_deadline_share() -> None:
    # 50 tasks/s, deadline 2 s, half of it for waiting: 50 tasks may be ahead of one more.
    assert judge(49, 1, 50.0, 2.0, 0.5) is None
    refusal = judge(150, 1, 50.0, 2.0, 0.5)
    assert refusal is not None
    assert refusal.predicted_s == pytest.approx(151 / 50) and refusal.budget_s == pytest.approx(1.0)
    assert refusal.retry_after_s == 3  # ceil(3.02 - 1.0): the backlog drains to where the request fits
    text = refusal.message("m", 1)
    assert "150 tasks are ahead" in text and "50 tasks/s" in text and "Retry after 3 s" in text
    assert judge(10**9, 1, 1.0, 1.0, 0.5).retry_after_s == MAX_RETRY_AFTER_S  # type: ignore[union-attr]
    assert judge(60, 1, 50.0, 2.0, 0.5, min_retry_after_s=5).retry_after_s == 5  # type: ignore[union-attr]


def _hb(worker: str, bases: list[str], rates: dict[str, float], draining: bool = False) -> wire.Heartbeat:
    return wire.Heartbeat(worker=worker, bases=bases, adapters={}, in_flight=0, batches_per_s=0.0, tasks_done=0,
                          pid=1, host="h", draining=draining, service_rates=rates)


def test_service_rate_sums_live_workers_of_the_base() -> None:
    reg = WorkerRegistry(liveness_s=5.0)
    assert reg.service_rate("a", now=0.0) is None
    reg.observe(_hb("w1", ["a", "b"], {"a": 40.0, "b": 10.0}), now=0.0)
    reg.observe(_hb("w2", ["a"], {"a": 60.0}), now=1.0)
    reg.observe(_hb("w3", ["a"], {}), now=1.0)  # not measured yet: adds nothing
    reg.observe(_hb("w4", ["a"], {"a": 500.0}, draining=True), now=1.0)
    reg.observe(_hb("w5", [], {"a": 500.0}), now=1.0)  # its consumer for a is missing: it does not pull for a
    assert reg.service_rate("a", now=2.0) == 100.0 and reg.service_rate("b", now=2.0) == 10.0
    assert reg.service_rate("a", now=5.5) == 60.0  # w1's heartbeat is too old


def test_heartbeat_rates_are_optional_and_checked() -> None:
    hb = _hb("w", ["a"], {"a": 12.5})
    assert wire.Heartbeat.from_wire(hb.to_wire()).service_rates == {"a": 12.5}
    old = wire.pack({"v": 1, "w": "w", "b": ["a"], "a": {}, "f": 0, "bps": 0.0, "td": 0, "pid": 1, "h": "h",
                     "ts": 0.0, "dr": False})  # a worker from before issue 12
    assert wire.Heartbeat.from_wire(old).service_rates == {}
    for bad in ({"a": True}, {"a": -1.0}, {"a": "fast"}, {"a": float("nan")}):
        body = wire.unpack(hb.to_wire())
        body["sr"] = bad
        with pytest.raises(wire.WireError, match="'sr'"):
            wire.Heartbeat.from_wire(wire.pack(body))


async def test_pending_counts_outstanding_tasks_per_base() -> None:
    table = PendingTable()
    table.add("r1", "a", 3, 10.0)
    table.add("r2", "a", 2, 10.0)
    table.add("r3", "b", 1, 10.0)
    assert (table.outstanding("a"), table.outstanding("b"), table.outstanding("c")) == (5, 1, 0)
    table.deliver("r1", wire.Result("r1.0", 0, "w", vector=b"\0" * 4, dim=1))
    assert table.outstanding("a") == 4
    table.deliver("r2", wire.Result("r2.1", 1, "w", error_code=wire.ERR_RUNTIME))  # fails the request: all gone
    assert table.outstanding("a") == 2
    table.discard("r1")  # answered, timed out or abandoned
    table.discard("r1")
    assert table.outstanding("a") == 0 and table.outstanding("b") == 1
