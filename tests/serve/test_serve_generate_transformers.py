"""Generative serving end to end with the in-process `transformers` runtime: the official `openai` client
against a real cluster (nats-server, a worker, the gateway) serving the tiny random Llama with two LoRAs,
and the packaged SmolLM2-135M-Instruct, on one worker.

Outputs through the cluster equal direct transformers generation (greedy, one prompt at a time), streamed
or not, through the chat template or as plain completions; the error contract; a specialist's system
prompt; and a client that goes away (or a deadline that passes) stops the generation in the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from generate_kit import BASE, GREEDY, QUESTIONS, build_tiny, chat, fleet, put_fleet_entry, transformers_reference

from lorafleet.core.config import BaseModelSpec
from lorafleet.core.fleet_state import FleetEntry
from lorafleet.ops.cluster import LocalCluster

pytestmark = pytest.mark.integration

SMOL = "SmolLM2-135M-Instruct"
FRANCE = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_tiny(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def cluster(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    pytest.importorskip("gguf")
    home = tmp_path_factory.mktemp("gen-tf-home")
    cfg = fleet(tiny, "transformers")
    cfg.bases.append(BaseModelSpec(name=SMOL, source=SMOL, runtime="transformers", options={"max_model_len": 1024}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAFLEET_HOME", str(home))  # the converted SmolLM2 is cached there, for every part
        mp.setenv("LORAFLEET_CLOCK_SKEW_S", "0")  # one host, one clock: a deadline is a deadline, to the ms
        with LocalCluster(cfg, workers=1, port=0, home=home) as c:
            yield c


@pytest.fixture
def client(cluster: LocalCluster) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny: dict[str, Path]) -> dict[tuple[str, str, str], str]:
    """(served name, "chat" | "completion", question) → direct transformers text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["base"])
    rendered = [tok.apply_chat_template(chat(q), add_generation_prompt=True, tokenize=False) for q in QUESTIONS]
    out = {}
    for name, adapter in ((BASE, None), ("tiny-a", tiny["a"]), ("tiny-b", tiny["b"])):
        chats = transformers_reference(tiny["base"], adapter, rendered, GREEDY["max_tokens"], add_special_tokens=False)
        plain = transformers_reference(tiny["base"], adapter, QUESTIONS, GREEDY["max_tokens"], add_special_tokens=True)
        for q, c, p in zip(QUESTIONS, chats, plain, strict=True):
            out[(name, "chat", q)], out[(name, "completion", q)] = c, p
    return out


def streamed(stream: Any) -> tuple[str, str | None, Any]:
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text = choice.delta.content if hasattr(choice, "delta") else choice.text
            parts.append(text or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish, usage


def test_models_list_their_kind(client: Any) -> None:
    kinds = {m.id: m.kind for m in client.models.list().data}
    assert kinds == {BASE: "causal-lm", "tiny-a": "causal-lm", "tiny-b": "causal-lm", SMOL: "causal-lm"}


@pytest.mark.parametrize("name", [BASE, "tiny-a", "tiny-b"])
def test_outputs_equal_direct_transformers(client: Any, reference: dict, name: str) -> None:
    for q in QUESTIONS:
        r = client.chat.completions.create(model=name, messages=chat(q), **GREEDY)
        assert r.choices[0].message.content == reference[(name, "chat", q)]
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == GREEDY["max_tokens"]
        text, finish, usage = streamed(client.chat.completions.create(
            model=name, messages=chat(q), stream=True, stream_options={"include_usage": True}, **GREEDY))
        assert (text, finish) == (reference[(name, "chat", q)], "length")
        assert usage.prompt_tokens == r.usage.prompt_tokens and usage.completion_tokens == GREEDY["max_tokens"]
        c = client.completions.create(model=name, prompt=q, **GREEDY)
        assert c.choices[0].text == reference[(name, "completion", q)]
        assert streamed(client.completions.create(model=name, prompt=q, stream=True, **GREEDY))[0] == \
            reference[(name, "completion", q)]
    assert reference[(name, "chat", QUESTIONS[0])] != reference[(name, "completion", QUESTIONS[0])]  # template


def test_adapters_interleaved_under_concurrency(client: Any, reference: dict) -> None:
    names = [BASE, "tiny-a", "tiny-b"] * 4
    q = QUESTIONS[0]  # one prompt length: batches of one adapter need no padding, so greedy stays exact

    def one(name: str) -> str:
        return client.chat.completions.create(model=name, messages=chat(q), **GREEDY).choices[0].message.content

    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(one, names))
    assert got == [reference[(n, "chat", q)] for n in names]


def test_smollm2_short_answer(client: Any, cluster: LocalCluster) -> None:
    from transformers import AutoTokenizer

    from lorafleet.models.causal import resolve_causal_source

    r = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": FRANCE}], max_tokens=12,
                                       temperature=0)
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAFLEET_HOME", str(cluster.home))
        folder = resolve_causal_source(SMOL)  # the cluster's cached conversion
    rendered = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        [{"role": "user", "content": FRANCE}], add_generation_prompt=True, tokenize=False)
    assert r.choices[0].message.content == transformers_reference(folder, None, [rendered], 12, False)[0]


def test_error_contract(client: Any, cluster: LocalCluster) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match=r"context of 512 tokens.*max_tokens is 600"):
        client.chat.completions.create(model=BASE, messages=chat("hi"), max_tokens=600)
    with pytest.raises(openai.BadRequestError, match=r"context of 512 tokens; this prompt has \d+ tokens"):
        client.completions.create(model=BASE, prompt="fox " * 600, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match=r"does not support 'logprobs', 'presence_penalty'"):
        client.chat.completions.create(model=BASE, messages=chat("hi"), logprobs=True, presence_penalty=0.5)
    client.chat.completions.create(model=BASE, messages=chat("hi"), max_tokens=2, presence_penalty=0)  # neutral: ok
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        client.chat.completions.create(model=BASE, messages=chat("hi"), n=2)
    with pytest.raises(openai.BadRequestError, match=r"generates text; use POST /v1/chat/completions"):
        client.embeddings.create(model=BASE, input="hi")
    with pytest.raises(openai.NotFoundError, match="served models"):
        client.chat.completions.create(model="nope", messages=chat("hi"))
    r = httpx.post(f"{cluster.gateway_url}/v1/encode/{BASE}", content=b"\x80", timeout=10)
    assert r.status_code == 400 and "generates text" in r.json()["error"]["message"]


def test_specialist_system_prompt_applies_when_the_request_brings_none(
        client: Any, cluster: LocalCluster, tiny: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    system = "You answer in German."
    entry = FleetEntry(name="tiny-sys", base=BASE, adapter_id="tiny-sys@v1", adapter_uri=str(tiny["a"]), version="1",
                       registered_model="tiny-sys", kind="causal-lm", system_prompt=system,
                       generation={"max_tokens": 8, "temperature": 0.0})
    asyncio.run(put_fleet_entry(cluster, entry))
    deadline = time.monotonic() + 10
    while "tiny-sys" not in {m.id for m in client.models.list().data}:
        assert time.monotonic() < deadline, "the promoted name never showed up"
        time.sleep(0.1)
    tok = AutoTokenizer.from_pretrained(tiny["base"])
    q = QUESTIONS[1]
    with_system = tok.apply_chat_template(chat(q, system), add_generation_prompt=True, tokenize=False)
    own = tok.apply_chat_template(chat(q, "Be brief."), add_generation_prompt=True, tokenize=False)
    expected = transformers_reference(tiny["base"], tiny["a"], [with_system, own], 8, False)
    r = client.chat.completions.create(model="tiny-sys", messages=chat(q))  # defaults: greedy, 8 tokens
    assert r.choices[0].message.content == expected[0] and r.usage.completion_tokens == 8
    r = client.chat.completions.create(model="tiny-sys", messages=chat(q, "Be brief."))
    assert r.choices[0].message.content == expected[1]


def _settled(cluster: LocalCluster, what: str, since: int) -> bool:
    return what in cluster.log_path("worker-1").read_text(errors="replace")[since:]


def _wait_log(cluster: LocalCluster, what: str, since: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not _settled(cluster, what, since):
        assert time.monotonic() < deadline, (f"the worker never logged {what!r}; its log since:\n"
                                             + cluster.log_path("worker-1").read_text(errors="replace")[since:][-3000:])
        time.sleep(0.1)


def test_client_going_away_or_deadline_stops_generation(cluster: LocalCluster) -> None:
    # SmolLM2 runs each prompt here to all 480 tokens without an end token (greedy; ~14 s on this 2-core box, at
    # least ~0.5 s on any CPU), so neither the client's give-up nor the 2 s deadline can lose a race to the answer.
    long = {"model": SMOL, "max_tokens": 480, "temperature": 0}
    url = f"{cluster.gateway_url}/v1/completions"
    since = len(cluster.log_path("worker-1").read_text(errors="replace"))
    with httpx.stream("POST", url, json={**long, "prompt": "fox", "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first event: then the client goes away
    _wait_log(cluster, ": cancelled → ack", since)
    since = len(cluster.log_path("worker-1").read_text(errors="replace"))
    with contextlib.suppress(httpx.ReadTimeout):
        # Not streaming: gives up waiting long before the answer could be done.
        httpx.post(url, json={**long, "prompt": "brown"}, timeout=1.0)
    _wait_log(cluster, ": cancelled → ack", since)
    since = len(cluster.log_path("worker-1").read_text(errors="replace"))
    for _ in range(50):  # admission control refuses (429) while the cancelled tasks are still counted as backlog
        r = httpx.post(url, json={**long, "prompt": "quick"}, headers={"X-Lorafleet-Deadline-Ms": "2000"}, timeout=60)
        if r.status_code != 429:
            break
        time.sleep(0.2)
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    _wait_log(cluster, "deadline passed while generating", since)
