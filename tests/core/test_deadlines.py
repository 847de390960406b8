"""Deadlines across hosts whose clocks disagree (issue 23, item 6): a worker's deadline checks go through
deadlines.local_deadline, which trusts the gateway's budget (deadline - enqueued, one clock) and the absolute
deadline only within a stated tolerance."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from lorafleet.core.wire import Task
from lorafleet.sidecar import intake as intake_module
from lorafleet.sidecar.acks import Situation
from lorafleet.sidecar.intake import Intake

TOLERANCE = 5.0  # what this test's fleet promises: clocks within 5 s of each other


def task(sent: float, budget: float, i: int = 0) -> Task:
    """A task the gateway published at `sent` (its clock) with `budget` seconds to go."""
    return Task(id=f"r.{i}", request_id="r", index=i, model="m", base="b", text="x", tokens=1,
                deadline=sent + budget, reply="_INBOX.gw.r", enqueued=sent)


@dataclass
class FakeHeld:
    msgs: list[Any] = field(default_factory=list)

    def add(self, msg: Any) -> None:
        self.msgs.append(msg)


@dataclass
class FakeSettler:
    refused: list[tuple[Any, ...]] = field(default_factory=list)

    async def settle_many(self, refused: list[tuple[Any, ...]]) -> None:
        self.refused.extend(refused)


def admit_with_clock(monkeypatch: pytest.MonkeyPatch, skew_s: float, tasks: list[Task]) -> tuple[list[str], list[str]]:
    """Intake on a worker whose wall clock is `skew_s` ahead of the gateway's (negative: behind): (taken, dropped)."""
    monkeypatch.setenv("LORAFLEET_CLOCK_SKEW_S", str(TOLERANCE))
    monkeypatch.setattr(intake_module, "time", SimpleNamespace(time=lambda: time.time() + skew_s,
                                                               monotonic=time.monotonic))
    settler = FakeSettler()
    intake = Intake(FakeHeld(), settler)  # type: ignore[arg-type]
    msgs = [SimpleNamespace(data=t.to_wire()) for t in tasks]
    pulled = asyncio.run(intake.admit("b", msgs))
    assert all(r.situation is Situation.DEADLINE for r in settler.refused)
    return [p.task.id for p in pulled], [r.task.id for r in settler.refused]


def test_a_worker_ahead_by_seconds_still_computes_a_task_with_budget_left(monkeypatch: pytest.MonkeyPatch) -> None:
    now = time.time()
    # Published just now with 2 s to go; the worker's clock reads 4 s later than the gateway's.
    taken, dropped = admit_with_clock(monkeypatch, +4.0, [task(now, 2.0)])
    assert (taken, dropped) == (["r.0"], [])


def test_a_worker_behind_by_seconds_still_drops_an_expired_task(monkeypatch: pytest.MonkeyPatch) -> None:
    now = time.time()
    # Worker 4 s behind. r.0 expired 10 s ago (past the bound: tolerance + skew = 9 s); r.1 has 3 s left.
    taken, dropped = admit_with_clock(monkeypatch, -4.0, [task(now - 12.0, 2.0, 0), task(now, 3.0, 1)])
    assert (taken, dropped) == (["r.1"], ["r.0"])


def test_a_fresh_task_is_dropped_within_tolerance_whatever_the_worker_lags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget holds on one clock: a worker 30 s behind (far beyond the tolerance) still lets a task go
    `tolerance` after its budget ran out, not 30 s later."""
    from lorafleet.core.deadlines import local_deadline

    sent = 1_000_000.0
    t = task(sent, 2.0)
    received = sent - 30.0 + 0.01  # the worker's clock, 10 ms after publish
    assert local_deadline(t, received, TOLERANCE) == pytest.approx(received + 2.0 + TOLERANCE)


@pytest.mark.parametrize("skew", [-TOLERANCE, -3.0, -0.5, 0.0, 0.5, 3.0, TOLERANCE])
def test_never_early_and_late_by_at_most_the_stated_bound(skew: float) -> None:
    """For every skew within the tolerance, wait in the queue and budget: the worker lets a task go no earlier
    than its true deadline and at most tolerance + min(|skew| if behind, wait) after it."""
    from lorafleet.core.deadlines import local_deadline

    sent = 1_000_000.0  # the gateway's clock = true time
    for wait, budget in itertools.product([0.0, 0.2, 3.0, 20.0], [0.1, 2.0, 30.0]):
        t = task(sent, budget)
        received_true = sent + wait
        local = local_deadline(t, received_true + skew, TOLERANCE)
        let_go_true = local - skew  # the true time at which the worker's clock reaches `local`
        assert let_go_true >= t.deadline - 1e-9, (skew, wait, budget)
        behind = max(-skew, 0.0)
        assert let_go_true - t.deadline <= TOLERANCE + min(behind, wait) + 1e-9, (skew, wait, budget)


def test_the_local_deadline_is_fixed_once_and_old_gateways_still_work() -> None:
    from lorafleet.core.deadlines import clock_skew_s, local_deadline, passed

    t = task(100.0, 2.0)
    first = local_deadline(t, 100.0, 0.5)
    assert first == 102.5 and t.expires == first and local_deadline(t, 500.0, 9.0) == first
    assert not passed(t, 102.4) and passed(t, 102.5)
    old = Task.from_wire(task(100.0, 2.0).to_wire())
    old.enqueued = 0.0  # a gateway that sent no publish time
    assert local_deadline(old, 50.0, 0.5) == 102.5
    assert clock_skew_s({}) == 0.25 and clock_skew_s({"LORAFLEET_CLOCK_SKEW_S": "3"}) == 3.0
    with pytest.raises(ValueError, match="LORAFLEET_CLOCK_SKEW_S"):
        clock_skew_s({"LORAFLEET_CLOCK_SKEW_S": "soon"})
