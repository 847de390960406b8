"""The wire of generation (issue 14): task parameters, streamed chunks, engine heartbeats; strict and compatible."""

from __future__ import annotations

from typing import Any

import pytest

from lorafleet.core import wire
from lorafleet.core.wire import GenerateParams, Heartbeat, Result, Task, pack, unpack


def _task(params: dict[str, Any] | None) -> Task:
    return Task(id="r.0", request_id="r", index=0, model="m", base="b", text="hi", tokens=3, deadline=1e9,
                reply="_INBOX.gw.r", op=wire.GENERATE, params=params)


def test_generate_params_round_trip_and_defaults() -> None:
    p = GenerateParams(max_tokens=16, temperature=0.0, top_p=0.9, stop=("\n",), seed=7, stream=True, chat=True)
    task = Task.from_wire(_task(p.to_params()).to_wire())
    assert GenerateParams.of(task) == p and p.greedy
    assert GenerateParams.of(_task({"mt": 4})) == GenerateParams(max_tokens=4)
    assert GenerateParams(max_tokens=4).to_params() == {"mt": 4, "tm": 1.0, "tp": 1.0}  # defaults stay off the wire


@pytest.mark.parametrize(("params", "match"), [
    (None, "has no parameters"),
    ({}, "missing field 'mt'"),
    ({"mt": "4"}, "'mt' has the wrong type: str"),
    ({"mt": 0}, "'mt' must be at least 1"),
    ({"mt": 4, "st": 1}, "'st' has the wrong type: int"),
    ({"mt": 4, "sp": ["", "x"]}, "'sp' must be a list of non-empty strings"),
    ({"mt": 4, "tm": True}, "'tm' has the wrong type: bool"),
])
def test_bad_generate_params_are_malformed(params: dict[str, Any] | None, match: str) -> None:
    with pytest.raises(wire.MalformedTask, match=match):
        GenerateParams.of(_task(params))


def test_chunks_and_final_results() -> None:
    chunk = Result("r.0", 0, "w1", text="Hel", seq=0, attempt=2)
    back = Result.from_wire(chunk.to_wire())
    assert back == chunk and back.is_chunk and back.check() is None
    final = Result("r.0", 0, "w1", text="Hello", prompt_tokens=3, completion_tokens=2, finish_reason="stop", seq=2,
                   attempt=2)
    back = Result.from_wire(final.to_wire())
    assert back == final and not back.is_chunk
    old = unpack(Result("r.0", 0, "w1", text="Hello", finish_reason="stop").to_wire())
    assert "sq" not in old and "at" not in old  # an older gateway reads what it always read
    assert Result.from_wire(pack({**old, "sq": -1})).check() == "result has a negative chunk sequence number -1"
    with pytest.raises(wire.WireError, match="'sq' has the wrong type: str"):
        Result.from_wire(pack({**old, "sq": "0"}))


def test_engine_heartbeat_fields() -> None:
    hb = Heartbeat(worker="w", bases=["llm"], adapters={"llm": ["a"]}, in_flight=3, batches_per_s=0.0, tasks_done=9,
                   pid=1, host="h", ts=1.0, slots_used={"llm": 3}, slots={"llm": 32}, kv_cache={"llm": 0.25})
    assert Heartbeat.from_wire(hb.to_wire()) == hb
    plain = Heartbeat(worker="w", bases=["m"], adapters={}, in_flight=0, batches_per_s=0.0, tasks_done=0, pid=1,
                      host="h", ts=1.0)
    assert "su" not in unpack(plain.to_wire()) and Heartbeat.from_wire(plain.to_wire()).slots == {}
    with pytest.raises(wire.WireError, match="'kv' must map base names to non-negative numbers"):
        Heartbeat.from_wire(pack({**unpack(hb.to_wire()), "kv": {"llm": -1}}))
