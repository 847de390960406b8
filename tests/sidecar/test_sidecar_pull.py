"""Adaptive pull: the decision function, and a pull cycle against a scripted fake subscription."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import nats.errors
import pytest

from lorafleet.sidecar.pull import BACKLOG_TIMEOUT_S, IDLE_POLL_S, FetchStep, next_fetch, pull_cycle


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
