"""Unit tests of the gateway's pure logic: parsing, deadlines, resolver, tokens, auth, pending, liveness."""

from __future__ import annotations

import asyncio
import logging
import math

import msgpack
import pytest

from lorafleet.core import wire
from lorafleet.core.config import ConfigError, FleetConfig, ServedModel
from lorafleet.serve.auth import ApiKeys, load_api_keys
from lorafleet.serve.bases import native_dim
from lorafleet.serve.errors import ApiError, worker_error
from lorafleet.serve.parsing import deadline_seconds, parse_embeddings, parse_encode
from lorafleet.serve.pending import COMPLETE, DUPLICATE, FAILED, FILLED, LATE, MALFORMED, TIMEOUT, PendingTable
from lorafleet.serve.resolver import Resolver, Route
from lorafleet.serve.tokens import TokenCounter, estimate_tokens
from lorafleet.serve.workers import WorkerRegistry

BASE = "all-MiniLM-L6-v2"


def _raises(fn, status: int, code: str, fragment: str = "") -> ApiError:  # type: ignore[no-untyped-def]
    with pytest.raises(ApiError) as info:
        fn()
    assert (info.value.status, info.value.code) == (status, code)
    assert fragment in info.value.message
    return info.value


# ---- parsing -----------------------------------------------------------------------------------


def test_parse_embeddings_accepts_openai_shapes() -> None:
    req = parse_embeddings(b'{"model": "m", "input": "hello", "user": "u-1"}', 10)
    assert (req.model, req.inputs, req.encoding_format, req.dimensions) == ("m", ["hello"], "float", None)
    req = parse_embeddings(b'{"model": "m", "input": ["a", "b"], "encoding_format": "base64", "dimensions": 384}', 10)
    assert (req.inputs, req.encoding_format, req.dimensions) == (["a", "b"], "base64", 384)
    assert parse_embeddings(b'{"model": "m", "input": "a", "encoding_format": null}', 1).encoding_format == "float"


@pytest.mark.parametrize(
    ("body", "code", "fragment"),
    [
        (b"", "invalid_json", "empty"),
        (b"{", "invalid_json", "not valid JSON"),
        (b'"x"', "invalid_json", "got a string"),
        (b'{"input": "a"}', "missing_model", "GET /v1/models"),
        (b'{"model": "", "input": "a"}', "missing_model", "non-empty"),
        (b'{"model": "m"}', "missing_input", "'input' is missing"),
        (b'{"model": "m", "input": 5}', "invalid_input", "got a number"),
        (b'{"model": "m", "input": []}', "empty_input", "empty list"),
        (b'{"model": "m", "input": ["a", null]}', "invalid_input", "input[1] is null"),
        (b'{"model": "m", "input": ["", "a"]}', "empty_input", "input[0] is an empty string"),
        (b'{"model": "m", "input": ["a", "b", "c"]}', "too_many_inputs", "has 3 items; this gateway accepts at most 2"),
        (b'{"model": "m", "input": "a", "encoding_format": "binary"}', "invalid_encoding_format", "'binary'"),
        (b'{"model": "m", "input": "a", "dimensions": true}', "invalid_dimensions", "True"),
        (b'{"model": "m", "input": "a", "dimensions": -1}', "invalid_dimensions", "-1"),
    ],
)
def test_parse_embeddings_rejects(body: bytes, code: str, fragment: str) -> None:
    _raises(lambda: parse_embeddings(body, 2), 400, code, fragment)


def test_parse_encode() -> None:
    req = parse_encode(msgpack.packb({"inputs": ["a", "b"], "deadline_ms": 250}), 4)
    assert (req.inputs, req.deadline_ms) == (["a", "b"], 250.0)
    assert parse_encode(msgpack.packb({"inputs": "solo"}), 4).inputs == ["solo"]
    _raises(lambda: parse_encode(b"", 4), 400, "invalid_msgpack", "empty")
    _raises(lambda: parse_encode(b"\x92\x01", 4), 400, "invalid_msgpack", "not valid MessagePack")
    _raises(lambda: parse_encode(msgpack.packb({"inputs": ["a"], "deadline_ms": "1"}), 4), 400, "invalid_deadline")
    _raises(lambda: parse_encode(msgpack.packb({"inputs": [1]}), 4), 400, "invalid_input", "inputs[0]")


def test_deadline_precedence_and_cap() -> None:
    assert deadline_seconds(None, None, 30.0, 300.0) == 30.0
    assert deadline_seconds("1500", None, 30.0, 300.0) == 1.5
    assert deadline_seconds("1500", 250.0, 30.0, 300.0) == 0.25  # body wins over the header
    assert deadline_seconds("10000000", None, 30.0, 300.0) == 300.0  # capped at max_deadline_s
    assert deadline_seconds(None, None, 500.0, 300.0) == 300.0
    _raises(lambda: deadline_seconds("0", None, 30.0, 300.0), 400, "invalid_deadline")
    _raises(lambda: deadline_seconds("nan", None, 30.0, 300.0), 400, "invalid_deadline")
    _raises(lambda: deadline_seconds("inf", None, 30.0, 300.0), 400, "invalid_deadline")
    _raises(lambda: deadline_seconds("abc", None, 30.0, 300.0), 400, "invalid_deadline", "'abc'")


# ---- resolver ----------------------------------------------------------------------------------


def test_resolver_routes_bases_and_adapters() -> None:
    fleet = FleetConfig(models=[ServedModel(name="german-legal", base=BASE, adapter="/a/gl", adapter_id="gl@2")])
    r = Resolver.from_fleet(fleet)
    assert r.resolve(BASE) == Route(BASE, BASE)
    assert r.resolve("german-legal") == Route("german-legal", BASE, "gl@2", "/a/gl")
    assert r.resolve("nope") is None
    assert r.served_names() == sorted([BASE, "german-legal"])


def test_resolver_set_models_swaps_atomically_and_validates() -> None:
    r = Resolver([BASE, "e5-small"])
    r.set_models([ServedModel(name="tax", base="e5-small", adapter="s3://b/tax")])
    assert r.resolve("tax") == Route("tax", "e5-small", "tax", "s3://b/tax")
    before = r.served_names()
    with pytest.raises(ConfigError, match="not among bases"):
        r.set_models([ServedModel(name="ok", base=BASE, adapter="x"),
                      ServedModel(name="bad", base="nope", adapter="y")])
    with pytest.raises(ConfigError, match="used twice"):
        r.set_models([ServedModel(name=BASE, base=BASE, adapter="x")])
    with pytest.raises(ConfigError, match="not among bases"):  # an adapter of an adapter is not a thing
        r.set_models([ServedModel(name="a", base=BASE, adapter="x"), ServedModel(name="b", base="a", adapter="y")])
    assert r.served_names() == before  # a failed update changes nothing
    r.set_models([])
    assert r.served_names() == sorted([BASE, "e5-small"])


# ---- tokens ------------------------------------------------------------------------------------


def test_estimate_tokens() -> None:
    assert estimate_tokens("abc") == 3  # ceil(3/3) + 2
    assert estimate_tokens("abcd") == 4
    assert estimate_tokens("ä") == 3  # 2 utf-8 bytes
    assert TokenCounter(None).count(["abcdef", "a"]) == [4, 3]
    assert not TokenCounter(None).exact


def test_token_counter_counts_specials_and_ignores_file_truncation() -> None:
    counter = TokenCounter.for_source(BASE)
    assert counter.exact
    (short,) = counter.count(["hello world"])
    assert short == 4  # [CLS] hello world [SEP]
    # MiniLM's tokenizer.json truncates and pads to 128; the counter must see the full length.
    (long_,) = counter.count(["word " * 300])
    assert long_ == 302


def test_token_counter_falls_back_without_tokenizer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    counter = TokenCounter.for_source(str(tmp_path))  # a folder without tokenizer.json
    assert not counter.exact
    assert counter.count(["x" * 30]) == [12]


def test_native_dim_of_packaged_minilm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert native_dim(BASE) == 384
    assert native_dim(str(tmp_path)) is None


# ---- auth --------------------------------------------------------------------------------------


def test_api_keys_from_config_and_env() -> None:
    assert load_api_keys([" a ", ""], {"LORAFLEET_API_KEYS": "b, ,c,a"}) == ["a", "b", "c"]
    assert load_api_keys([], {}) == []


def test_api_key_check() -> None:
    ApiKeys([]).check(None)  # auth off
    keys = ApiKeys(["k1", "k2"])
    keys.check("Bearer k2")
    keys.check("bearer k1")
    err = _raises(lambda: keys.check(None), 401, "missing_api_key", "Bearer")
    assert err.headers and "WWW-Authenticate" in err.headers
    _raises(lambda: keys.check("Bearer "), 401, "missing_api_key")
    _raises(lambda: keys.check("Token k1"), 401, "missing_api_key")
    _raises(lambda: keys.check("Bearer k3"), 403, "invalid_api_key")
    _raises(lambda: keys.check("Bearer k1k2"), 403, "invalid_api_key")


def test_worker_error_mapping(caplog: pytest.LogCaptureFixture) -> None:
    def failed(code: str, message: str | None = None, index: int = 0) -> wire.Result:
        return wire.Result("r1.0", index, "w1", error_code=code, error_message=message)

    assert worker_error(failed(wire.ERR_DEADLINE), "r1", 1).status == 504
    with caplog.at_level(logging.INFO, logger="lorafleet.serve"):
        e = worker_error(failed(wire.ERR_ADAPTER, "no such adapter /srv/x\nsecond line", 3), "r1", 2)
    assert (e.status, e.code, e.headers, e.request_id) == (503, "adapter_unavailable", {"Retry-After": "2"}, "r1")
    assert "/srv/x" not in e.message and "r1" in e.message  # the worker's text is logged, never answered
    assert any("r1" in rec.getMessage() and "no such adapter /srv/x second line" in rec.getMessage()
               for rec in caplog.records)
    assert worker_error(failed(wire.ERR_MALFORMED), "r1", 1).status == 500
    assert worker_error(failed(wire.ERR_RUNTIME, "MemoryError: alloc_cpu.cpp"), "r1", 1).message.count("alloc") == 0
    assert worker_error(failed("something_new"), "r1", 1).code == "internal_error"
    refused = worker_error(failed(wire.ERR_INVALID, "the prompt has 600 tokens; the context is 512"), "r1", 1)
    assert (refused.status, refused.code) == (400, "invalid_request") and "600 tokens" in refused.message


# ---- pending requests --------------------------------------------------------------------------


def _result(i: int, error: str | None = None) -> wire.Result:
    return wire.Result(task_id=f"r.{i}", index=i, worker="w", vector=None if error else bytes(4 * i + 4),
                       dim=i + 1, error_code=error)


async def test_pending_fills_in_any_order_and_drops_duplicates_and_late() -> None:
    table = PendingTable()
    p = table.add("r", BASE, 3, timeout_s=5)
    assert table.tasks_in_flight() == 3
    assert table.deliver("r", _result(2)) == FILLED
    assert table.deliver("r", _result(2)) == DUPLICATE
    assert table.deliver("r", _result(7)) == MALFORMED
    assert table.deliver("r", _result(0)) == FILLED
    assert table.tasks_in_flight() == 1 and not p.future.done()
    assert table.deliver("r", _result(1)) == COMPLETE
    assert await p.future is None
    assert [r.index for r in p.results if r is not None] == [0, 1, 2]
    assert table.deliver("r", _result(1)) == LATE  # request answered: anything further is late
    assert table.deliver("unknown", _result(0)) == LATE
    assert len(table) == 0 and table.tasks_in_flight() == 0
    assert p.timer is None or p.timer.cancelled()


async def test_pending_error_result_fails_the_request_at_once() -> None:
    table = PendingTable()
    p = table.add("r", BASE, 3, timeout_s=5)
    assert table.deliver("r", _result(0)) == FILLED
    assert table.deliver("r", _result(1, wire.ERR_ADAPTER)) == FAILED
    value = await p.future
    assert isinstance(value, wire.Result) and value.error_code == wire.ERR_ADAPTER
    assert table.deliver("r", _result(2)) == LATE


async def test_pending_deadline_resolves_the_request() -> None:
    table = PendingTable()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    p = table.add("r", BASE, 2, timeout_s=0.05)
    table.deliver("r", _result(0))
    assert await asyncio.wait_for(p.future, 2) is TIMEOUT
    assert 0.04 <= loop.time() - t0 < 1.0
    assert "r" not in table and table.tasks_in_flight() == 0
    assert table.deliver("r", _result(1)) == LATE


async def test_pending_discard_cancels_the_timer() -> None:
    table = PendingTable()
    p = table.add("r", BASE, 1, timeout_s=0.01)
    table.discard("r")
    await asyncio.sleep(0.03)
    assert not p.future.done()  # abandoned, not expired: nobody awaits it any more


# ---- worker liveness ---------------------------------------------------------------------------


def _hb(worker: str, bases: list[str], draining: bool = False) -> wire.Heartbeat:
    return wire.Heartbeat(worker=worker, bases=bases, adapters={}, in_flight=0, batches_per_s=0.0, tasks_done=0,
                          pid=1, host="h", draining=draining)


def test_worker_registry_liveness() -> None:
    reg = WorkerRegistry(liveness_s=5.0)
    assert not reg.serves(BASE, now=100.0)
    reg.observe(_hb("w1", [BASE]), now=100.0)
    reg.observe(_hb("w2", [BASE, "e5"]), now=102.0)
    reg.observe(_hb("w3", ["e5"], draining=True), now=102.0)
    assert reg.serves(BASE, now=104.0) and reg.serves("e5", now=104.0)
    assert reg.live_counts([BASE, "e5", "x"], now=104.0) == {BASE: 2, "e5": 1, "x": 0}
    assert reg.live_counts([BASE], now=106.0) == {BASE: 1}  # w1 is older than 5 s now
    assert not reg.serves("e5", now=107.5)
    assert not math.isnan(reg.liveness_s)
