"""The gateway's generative logic without servers: OpenAI bodies, prompts against the context, and the
text stream that never duplicates or silently cuts, across a worker dying mid-stream."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from lorafleet.core.wire import Result
from lorafleet.serve.completions import CHAT, COMPLETION, Shaper, parse_generation
from lorafleet.serve.errors import ApiError
from lorafleet.serve.generation import prepare
from lorafleet.serve.resolver import Route, Specialist
from lorafleet.serve.textstream import TextStream


def body(**kw: Any) -> bytes:
    return orjson.dumps({"model": "m", **kw})


MSG = [{"role": "user", "content": "hi"}]


def test_chat_and_completion_bodies() -> None:
    b = parse_generation(body(messages=[{"role": "developer", "content": [{"type": "text", "text": "be "},
                                                                          {"type": "text", "text": "brief"}]}, *MSG],
                              max_completion_tokens=5, temperature=0, top_p=0.5, stop="\n", seed=3, n=1, stream=True,
                              stream_options={"include_usage": True}, user="u", presence_penalty=0, logprobs=False),
                         CHAT)
    assert b.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (b.max_tokens, b.temperature, b.top_p, b.stop, b.seed, b.stream, b.include_usage) == \
        (5, 0.0, 0.5, ["\n"], 3, True, True)
    c = parse_generation(body(prompt=["one"]), COMPLETION)
    assert c.prompt == "one" and c.max_tokens is None and c.temperature is None and not c.stream


@pytest.mark.parametrize(("kind", "raw", "code", "match"), [
    (CHAT, body(messages=MSG, logprobs=True, tools=[{"x": 1}]), "unsupported_parameter",
     r"does not support 'logprobs', 'tools'"),
    (CHAT, body(messages=MSG, n=2), "unsupported_parameter", "'n' must be 1"),
    (CHAT, body(messages=[]), "missing_messages", "non-empty list"),
    (CHAT, body(messages=[{"role": "tool", "content": "x"}]), "invalid_messages", "tools are not supported"),
    (CHAT, body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "invalid_messages", "text parts"),
    (CHAT, body(messages=MSG, max_tokens=0), "invalid_parameter", "'max_tokens' must be an integer of at least 1"),
    (CHAT, body(messages=MSG, temperature=3), "invalid_parameter", r"'temperature' must be a number in \[0, 2\]"),
    (CHAT, body(messages=MSG, stop=["a"] * 5), "invalid_parameter", "up to 4"),
    (CHAT, body(messages=MSG, stream_options={"include_usage": True}), "invalid_parameter", "only allowed with"),
    (COMPLETION, body(prompt=["a", "b"]), "unsupported_parameter", "one string"),
    (COMPLETION, body(prompt=[1, 2]), "unsupported_parameter", "token ids"),
    (COMPLETION, body(prompt="x", messages=MSG), "unsupported_parameter", "'messages'"),
    (COMPLETION, b"[1]", "invalid_json", "must be a JSON object"),
])
def test_bad_bodies_say_what_to_fix(kind: str, raw: bytes, code: str, match: str) -> None:
    with pytest.raises(ApiError, match=match) as err:
        parse_generation(raw, kind)  # type: ignore[arg-type]
    assert err.value.status == 400 and err.value.code == code


class Prompts:
    """A stand-in for CausalPrompts: one token per character, a visible template."""

    context = 40

    def render(self, messages: list[dict[str, str]], chat_template: str | None = None) -> str:
        return (chat_template or "") + "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def count(self, text: str, chat: bool) -> int:
        return len(text) + (0 if chat else 1)


def test_prepare_applies_the_specialist_and_checks_the_context() -> None:
    spec = Specialist(system_prompt="S", chat_template="T:", defaults={"max_tokens": 8, "temperature": 0.0})
    route = Route("legal", "base", "legal@v1", "models:/legal/1", spec)
    p = prepare(parse_generation(body(messages=MSG), CHAT), route, Prompts())  # type: ignore[arg-type]
    assert p.prompt == "T:<system>S<user>hi<assistant>" and p.params.chat
    assert (p.params.max_tokens, p.params.temperature, p.params.top_p) == (8, 0.0, 1.0)
    own = prepare(parse_generation(body(messages=[{"role": "system", "content": "X"}, *MSG], temperature=1.0),
                                   CHAT), route, Prompts())  # type: ignore[arg-type]
    assert own.prompt == "T:<system>X<user>hi<assistant>" and own.params.temperature == 1.0
    plain = prepare(parse_generation(body(prompt="abc"), COMPLETION), Route("base", "base"), Prompts())  # type: ignore[arg-type]
    assert (plain.prompt, plain.prompt_tokens, plain.params.max_tokens, plain.params.chat) == ("abc", 4, 36, False)
    with pytest.raises(ApiError, match=r"context of 40 tokens; the prompt has 4 tokens and max_tokens is 37: lower "
                                       r"max_tokens to at most 36") as err:
        prepare(parse_generation(body(prompt="abc", max_tokens=37), COMPLETION), Route("base", "base"), Prompts())  # type: ignore[arg-type]
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(ApiError, match="this prompt has 41 tokens: shorten it"):
        prepare(parse_generation(body(prompt="x" * 40), COMPLETION), Route("base", "base"), Prompts())  # type: ignore[arg-type]


def chunk(text: str, seq: int, attempt: int = 1) -> Result:
    return Result("t", 0, "w", text=text, seq=seq, attempt=attempt)


def final(text: str, attempt: int = 1, chunks: int = 0) -> Result:
    return Result("t", 0, "w", text=text, finish_reason="stop", prompt_tokens=3, completion_tokens=5, seq=chunks,
                  attempt=attempt)


def events(s: TextStream) -> list[tuple[str, str]]:
    out = []
    while not s.events.empty():
        e = s.events.get_nowait()
        out.append((e.kind, e.text or e.code))
    return out


async def test_stream_in_order() -> None:
    s = TextStream()
    for i, t in enumerate(["He", "llo", " you"]):
        s.chunk(chunk(t, i))
    s.final(final("Hello you", chunks=3))
    s.chunk(chunk("late", 3))  # after the end: ignored
    assert events(s) == [("delta", "He"), ("delta", "llo"), ("delta", " you"), ("final", "")]


async def test_redelivery_skips_the_prefix_the_client_has() -> None:
    s = TextStream()
    s.chunk(chunk("The ", 0))
    s.chunk(chunk("sea", 1))  # the worker dies here; the task is delivered again, from the start
    for i, t in enumerate(["Th", "e s", "ea is", " wide"]):
        s.chunk(chunk(t, i, attempt=2))
    s.chunk(chunk("zzz", 2, attempt=1))  # the dead delivery's leftovers: dropped
    s.final(final("The sea is wide", attempt=2, chunks=4))
    assert "".join(t for k, t in events(s) if k == "delta") == "The sea is wide"


async def test_a_restart_that_differs_ends_with_an_explicit_error() -> None:
    s = TextStream()
    s.chunk(chunk("The sea", 0))
    s.chunk(chunk("The sky", 0, attempt=2))
    s.chunk(chunk(" more", 1, attempt=2))
    assert events(s) == [("delta", "The sea"), ("error", "stream_interrupted")]
    t = TextStream()
    t.chunk(chunk("Hello wor", 0))
    t.final(final("Hello", attempt=2))  # shorter than what the client has: never a silent cut
    assert events(t)[-1] == ("error", "stream_interrupted")


async def test_a_lost_chunk_is_filled_in_by_the_final_result() -> None:
    s = TextStream()
    s.chunk(chunk("a", 0))
    s.chunk(chunk("c", 2))  # "b" (seq 1) was lost while the gateway reconnected
    s.chunk(chunk("d", 3))
    s.final(final("abcd", chunks=4))
    assert events(s) == [("delta", "a"), ("delta", "bcd"), ("final", "")]


async def test_shaper_speaks_openai() -> None:
    sh = Shaper(CHAT, "legal", "rq1", created=5)
    whole = orjson.loads(sh.whole("Hi", "stop", 3, 1))
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"] == {"role": "assistant",
                                                                                        "content": "Hi"}
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    first = orjson.loads(sh.event(None, role=True)[6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert orjson.loads(Shaper(COMPLETION, "m", "r").event("x")[6:])["choices"][0]["text"] == "x"
    await asyncio.sleep(0)


def test_fleet_entries_of_generative_bundles_become_specialists() -> None:
    from lorafleet.core.fleet_state import FleetEntry
    from lorafleet.serve.gateway import specialists

    entries = [FleetEntry(name="headings", base="smol", adapter_id="headings@v2", adapter_uri="models:/headings/2",
                          version="2", registered_model="headings", kind="causal-lm", system_prompt="S",
                          generation={"max_tokens": 16, "temperature": 0.0}),
               FleetEntry(name="legal", base="mini", adapter_id="legal@v1", adapter_uri="models:/legal/1", version="1",
                          registered_model="legal")]
    assert specialists(entries) == {"headings": Specialist("S", None, {"max_tokens": 16, "temperature": 0.0})}
    assert FleetEntry.from_bytes(entries[0].to_bytes()) == entries[0]
    old = orjson.loads(entries[1].to_bytes())
    for key in ("kind", "system_prompt", "chat_template", "generation"):
        old.pop(key)
    assert FleetEntry.model_validate(old).system_prompt is None  # entries written before issue 14 still read
