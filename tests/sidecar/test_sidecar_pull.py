"""Adaptive pull: the decision function, the arrival rate, and a pull cycle against a scripted fake subscription."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import nats.errors
import pytest

from lorafleet.sidecar.pull import (
    BACKLOG_TIMEOUT_S,
    IDLE_POLL_S,
    ArrivalRate,
    BatchTime,
    FetchStep,
    fill,
    next_fetch,
    wait_first,
)


def test_backlog_fetches_what_is_pending_without_waiting() -> None:
    assert next_fetch(1, 32, 100, False, 2.0) == FetchStep(31, BACKLOG_TIMEOUT_S)
    assert next_fetch(1, 32, 5, False, 2.0) == FetchStep(5, BACKLOG_TIMEOUT_S)


def test_idle_waits_once_for_max_wait_ms() -> None:
    assert next_fetch(1, 32, 0, False, 2.0) == FetchStep(31, 0.002, fill_wait=True)
    assert next_fetch(3, 32, 0, True, 2.0) is None  # already waited once
    assert next_fetch(1, 32, 0, False, 0.0) is None  # waiting disabled


def test_full_batch_stops() -> None:
    assert next_fetch(32, 32, 100, False, 2.0) is None
    assert next_fetch(1, 1, 100, False, 2.0) is None


def test_batch_time_recovers_a_plus_b_n() -> None:
    t = BatchTime()
    assert t.max_items(0.2, 32) == 32  # nothing measured yet: the item cap
    for n in [1, 4, 9, 16, 32, 7, 3]:
        t.observe(n, 0.090 + 0.012 * n)  # a worker three times slower than 30 + 4·n ms
    a, b = t.coefficients()  # type: ignore[misc]
    assert a == pytest.approx(0.090) and b == pytest.approx(0.012)
    assert t.max_items(0.2, 32) == 9  # 90 + 12·9 = 198 ms
    assert t.max_items(1.0, 32) == 32  # the item cap still holds
    assert t.max_items(0.05, 32) == 1  # a budget below the fixed cost still runs one at a time


def test_batch_time_follows_a_worker_that_slows_down() -> None:
    t = BatchTime()
    for n in [2, 8, 16, 32] * 3:
        t.observe(n, 0.030 + 0.004 * n)
    assert t.max_items(0.2, 32) == 32
    for n in [2, 8, 16, 32] * 6:
        t.observe(n, 3 * (0.030 + 0.004 * n))
    assert t.max_items(0.2, 32) in (8, 9)  # exactly 9 once the old observations have decayed


def test_batch_time_of_one_size_errs_small_and_probes_upward() -> None:
    t = BatchTime()
    for _ in range(5):
        t.observe(32, 0.474)  # only full batches seen: no spread to separate a from b
    assert t.max_items(0.2, 32) == 13  # time charged per item: 32 × 200 / 474
    one = BatchTime()
    for _ in range(5):
        one.observe(1, 0.102)  # one at a time at low load; the per-item estimate alone would keep it at 1
    assert one.max_items(0.2, 32) == 2
    for _ in range(5):
        one.observe(2, 0.114)
    assert one.max_items(0.2, 32) == 9  # two sizes seen: the fit separates a from b


def test_batch_time_ignores_nonsense() -> None:
    t = BatchTime()
    t.observe(0, 1.0)
    t.observe(3, float("nan"))
    assert t.coefficients() is None and t.max_items(0.2, 32) == 32


def msg(pending: int) -> Any:
    return SimpleNamespace(metadata=SimpleNamespace(num_pending=pending))


class ScriptedSub:
    """Answers fetch calls from a script and records (n, timeout) of each call."""

    def __init__(self, script: list[list[Any] | None]) -> None:
        self.script = script
        self.calls: list[tuple[int, float]] = []

    async def fetch(self, n: int, timeout: float) -> list[Any]:
        self.calls.append((n, timeout))
        answer = self.script.pop(0)
        if answer is None:
            raise nats.errors.TimeoutError
        return answer[:n]


async def pull_cycle(sub: Any, cap: int, max_wait_ms: float) -> list[Any]:
    first = await wait_first(sub)
    return [] if first is None else await fill(sub, [first], cap, max_wait_ms)


async def test_idle_poll_returns_nothing() -> None:
    sub = ScriptedSub([None])
    assert await pull_cycle(sub, 32, 2.0) == []
    assert sub.calls == [(1, IDLE_POLL_S)]


async def test_backlog_cycle_fills_to_cap_quickly() -> None:
    sub = ScriptedSub([[msg(50)], [msg(49 - i) for i in range(7)]])
    got = await pull_cycle(sub, 8, 2.0)
    assert len(got) == 8
    assert sub.calls == [(1, IDLE_POLL_S), (7, BACKLOG_TIMEOUT_S)]


async def test_idle_cycle_waits_once_then_follows_new_backlog() -> None:
    # One task, nothing pending → one fill wait; it brings 2 and reports 3 more pending → fetch those.
    sub = ScriptedSub([[msg(0)], [msg(4), msg(3)], [msg(2), msg(1), msg(0)]])
    got = await pull_cycle(sub, 32, 2.0)
    assert len(got) == 6
    assert sub.calls == [(1, IDLE_POLL_S), (31, pytest.approx(0.002)), (3, BACKLOG_TIMEOUT_S)]


async def test_fill_wait_that_times_out_returns_what_it_has() -> None:
    sub = ScriptedSub([[msg(0)], None])
    assert len(await pull_cycle(sub, 32, 2.0)) == 1


def test_arrival_rate_tracks_a_steady_stream_and_decays_when_it_stops() -> None:
    rate = ArrivalRate(window_s=1.0)
    for i in range(2000):  # 200 tasks/s for 10 s
        rate.observe(1, i * 0.005)
    assert rate.per_s(10.0) == pytest.approx(200, rel=0.05)
    assert rate.per_s(13.0) < 200 * 0.06  # three windows later: e^-3 of it


def test_fill_wait_only_when_more_work_is_likely() -> None:
    rate = ArrivalRate(window_s=1.0)
    assert not rate.worth_waiting(2.0, 0.0)  # nothing seen yet
    for i in range(800):  # one client at a time: ~80 tasks/s for 10 s, 0.16 expected in 2 ms
        rate.observe(1, i * 0.0125)
    assert not rate.worth_waiting(2.0, 10.0)
    assert rate.worth_waiting(8.0, 10.0)  # 0.64 expected in 8 ms
    for i in range(5000):  # 500 tasks/s for 10 s: 1 expected in 2 ms
        rate.observe(1, 10.0 + i * 0.002)
    assert rate.worth_waiting(2.0, 20.0)
    assert not rate.worth_waiting(0.0, 20.0)  # waiting disabled
