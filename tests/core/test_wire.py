"""The wire codecs: every body round-trips, and every body is refused the same strict way when it is wrong."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from lorafleet.core.wire import (
    GENERATE,
    WIRE_VERSION,
    Heartbeat,
    MalformedTask,
    Result,
    Task,
    WireError,
    pack,
    reply_inbox,
    subject_token,
    unpack,
    work_subject,
)


def _task(**kw: Any) -> Task:
    base: dict[str, Any] = dict(id="r1.0", request_id="r1", index=0, model="legal", base="minilm", text="Kauf",
                                tokens=4, deadline=1e9, reply="_INBOX.gw.r1", adapter="legal@v1",
                                adapter_uri="models:/legal/1", enqueued=5.0)
    base.update(kw)
    return Task(**base)


def _hb() -> Heartbeat:
    return Heartbeat(worker="w1", bases=["minilm"], adapters={"minilm": ["legal@v1"]}, in_flight=2,
                     batches_per_s=3.5, tasks_done=10, pid=42, host="h", ts=1.0, draining=True)


def test_round_trips() -> None:
    t = _task()
    assert Task.from_wire(t.to_wire()) == t
    g = _task(op=GENERATE, params={"max_tokens": 16, "temperature": 0.0}, adapter=None, adapter_uri=None)
    assert Task.from_wire(g.to_wire()) == g
    embed = Result("r1.0", 0, "w1", vector=b"\x00" * 8, dim=2, queue_ms=1.5, batch_size=4)
    assert Result.from_wire(embed.to_wire()) == embed
    text = Result("r1.0", 0, "w1", text="Kaufvertrag", prompt_tokens=12, completion_tokens=3, finish_reason="stop")
    assert Result.from_wire(text.to_wire()) == text
    err = Result("r1.0", 0, "w1", error_code="runtime_error", error_message="boom")
    assert Result.from_wire(err.to_wire()) == err and not err.ok
    assert Heartbeat.from_wire(_hb().to_wire()) == _hb()


def _mutated(body: bytes, **changes: Any) -> bytes:
    d = unpack(body)
    for k, v in changes.items():
        if v is KeyError:
            d.pop(k)
        else:
            d[k] = v
    return pack(d)


@pytest.mark.parametrize(("decode", "body", "match"), [
    (Task.from_wire, b"\xc1", "task is not MessagePack"),
    (Task.from_wire, pack([1, 2]), "task body is not a map"),
    (Task.from_wire, _mutated(_task().to_wire(), v=2), "unsupported wire version 2"),
    (Task.from_wire, _mutated(_task().to_wire(), t=KeyError), "task is missing field 't'"),
    (Task.from_wire, _mutated(_task().to_wire(), n="4"), "task field 'n' has the wrong type: str"),
    (Task.from_wire, _mutated(_task().to_wire(), i=True), "task field 'i' has the wrong type: bool"),
    (Task.from_wire, _mutated(_task().to_wire(), a=3), "task field 'a' has the wrong type: int"),
    (Task.from_wire, _mutated(_task().to_wire(), op="train"), "task field 'op' is 'train'"),
    (Result.from_wire, b"", "result is not MessagePack"),
    (Result.from_wire, _mutated(Result("a", 0, "w").to_wire(), i="0"), "result field 'i' has the wrong type"),
    (Result.from_wire, _mutated(Result("a", 0, "w").to_wire(), x="text"), "result field 'x' has the wrong type"),
    (Result.from_wire, _mutated(Result("a", 0, "w").to_wire(), v=KeyError), "unsupported wire version None"),
    (Heartbeat.from_wire, _mutated(_hb().to_wire(), pid=KeyError), "heartbeat is missing field 'pid'"),
    (Heartbeat.from_wire, _mutated(_hb().to_wire(), b=[1]), "'b' must be a list of strings"),
    (Heartbeat.from_wire, _mutated(_hb().to_wire(), a={"minilm": "x"}), "'a' must map base names"),
    (Heartbeat.from_wire, _mutated(_hb().to_wire(), bps="fast"), "heartbeat field 'bps' has the wrong type"),
])
def test_bad_bodies_are_refused_naming_the_field(decode: Any, body: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode(body)


def test_a_bad_task_is_a_malformed_task() -> None:
    # The worker dead-letters MalformedTask; it must be what every task decoding error raises.
    with pytest.raises(MalformedTask):
        Task.from_wire(msgpack.packb({"v": WIRE_VERSION}))


def test_result_check_refuses_unusable_successes() -> None:
    assert Result("a", 0, "w", vector=b"\x00" * 8, dim=2).check() is None
    assert "8 vector bytes for dim 3" in (Result("a", 0, "w", vector=b"\x00" * 8, dim=3).check() or "")
    assert "neither a vector nor a text" in (Result("a", 0, "w").check() or "")
    assert Result("a", 0, "w", error_code="x").check() is None  # an error is a valid answer


def test_subjects_are_safe_tokens() -> None:
    assert subject_token("all-MiniLM-L6-v2") == "all-MiniLM-L6-v2"
    assert subject_token("org/model.v1 *>") == "org_model_v1___"
    assert work_subject("a.b") == "lorafleet.work.a_b"
    assert reply_inbox("gw 1", "r.1") == "_INBOX.gw_1.r_1"
    with pytest.raises(ValueError):
        subject_token("")
