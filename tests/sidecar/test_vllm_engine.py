"""The vLLM engine process on a tiny random Llama: output equals direct vLLM, streaming, chat,
runtime LoRA loading, cancellation, authentication and a dying engine.

Needs the vLLM venv (`python -m lorafleet.sidecar.vllm_install`, ~2 min, 3.5 GB); skips without it.
One engine serves the whole module (start ~25 s); the test that kills it runs last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from lorafleet.sidecar.vllm_engine import (
    EngineConfig,
    EngineDied,
    EngineRequestError,
    Finished,
    GenerateRequest,
    TextDelta,
    VllmEngine,
    write_support_files,
)
from lorafleet.sidecar.vllm_install import find_vllm_venv, venv_python
from lorafleet.testing import build_tiny_llama as shared_tiny_llama
from lorafleet.testing import wait_until_async

VENV = find_vllm_venv()
SKIP_REASON = ("vLLM venv not installed: run `python -m lorafleet.sidecar.vllm_install` "
               "(or `lorafleet runtime install vllm`); set LORAFLEET_VLLM_VENV to reuse one")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(VENV is None, reason=SKIP_REASON),
]

PROMPTS = ["The quick brown fox", "Workers pull tasks from the queue"]
# The tiny Llama's max_position_embeddings: streams long enough to cancel (see the cancel test).
MAX_MODEL_LEN = 8192
GREEDY = {"max_tokens": 16, "temperature": 0.0}
LORA_NAMES = ("a", "b", "c")

# ---- a tiny Llama and random LoRAs, built on the fly ------------------------------------------
def build_tiny_llama(out_dir: Path) -> Path:
    return shared_tiny_llama(out_dir, mute_special_tokens=True, max_positions=MAX_MODEL_LEN)


def make_lora(base: Path, out_dir: Path, seed: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
        task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(out_dir)
    return out_dir


# Direct vLLM generation in the vLLM venv, one prompt per call like the server sees them.
_REFERENCE_SCRIPT = '''
import json, sys
def main():
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    spec = json.loads(sys.argv[1])
    llm = LLM(model=spec["model"], enable_lora=True, max_loras=2, max_lora_rank=8, dtype="bfloat16",
              max_model_len=spec["max_model_len"], enforce_eager=True, seed=0)
    params = SamplingParams(**spec["greedy"])
    out = {}
    for name, path in [(None, None), *spec["loras"].items()]:
        lora = LoRARequest(name, len(out) + 1, path) if name else None
        out[name or ""] = [llm.generate([p], params, lora_request=lora, use_tqdm=False)[0].outputs[0].text
                           for p in spec["prompts"]]
    print("REFERENCE " + json.dumps(out), flush=True)
if __name__ == "__main__":
    main()
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-llama")
    base = build_tiny_llama(root / "base")
    paths = {"base": base}
    for seed, name in enumerate(LORA_NAMES, 1):
        paths[name] = make_lora(base, root / f"lora-{name}", seed)
    return paths


@pytest.fixture(scope="module")
def reference(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    assert VENV is not None
    run_dir = write_support_files(tmp_path_factory.mktemp("vllm-ref"))
    (run_dir / "reference.py").write_text(_REFERENCE_SCRIPT)
    spec = {"model": str(tiny["base"]), "max_model_len": MAX_MODEL_LEN, "greedy": GREEDY, "prompts": PROMPTS,
            "loras": {"a": str(tiny["a"]), "b": str(tiny["b"])}}
    env = {**os.environ, "PYTHONPATH": str(run_dir), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(venv_python(VENV)), str(run_dir / "reference.py"), json.dumps(spec)],
                          env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REFERENCE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("REFERENCE "))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny: dict[str, Path], reference: dict[str, list[str]]) -> AsyncIterator[VllmEngine]:
    eng = VllmEngine(EngineConfig(model=str(tiny["base"]), served_name="tiny", max_model_len=MAX_MODEL_LEN,
                                  max_loras=2, max_cpu_loras=4, max_lora_rank=8, max_num_seqs=16,
                                  kv_cache_gib=1, enforce_eager=True, log_requests=True))
    await eng.start()
    try:
        await eng.wait_ready(timeout=240)
        yield eng
    finally:
        pgid = eng.pid
        await eng.stop()
        assert pgid is not None
        with pytest.raises(ProcessLookupError):  # nothing of the engine's process group is left
            os.killpg(pgid, 0)


async def collect(engine: VllmEngine, req: GenerateRequest) -> tuple[list[str], Finished]:
    deltas: list[str] = []
    async with contextlib.aclosing(engine.stream(req)) as items:
        async for item in items:
            if isinstance(item, TextDelta):
                deltas.append(item.text)
            else:
                return deltas, item
    raise AssertionError("no Finished")


# ---- tests (file order matters: the last one kills the engine) ---------------------------------
async def test_base_and_two_loras_equal_direct_vllm(
        engine: VllmEngine, tiny: dict[str, Path], reference: dict[str, list[str]]) -> None:
    await engine.load_adapter("a", tiny["a"])
    await engine.load_adapter("b", tiny["b"])
    assert engine.loaded_adapters() == ["a", "b"]
    for adapter in [None, "a", "b", None, "b", "a"]:
        for prompt, expected in zip(PROMPTS, reference[adapter or ""], strict=True):
            text, fin = await engine.generate(GenerateRequest(prompt=prompt, adapter=adapter, **GREEDY))
            assert text == expected, (adapter, prompt)
            assert fin.finish_reason == "length" and fin.completion_tokens == 16 and fin.prompt_tokens > 0
    assert len({tuple(v) for v in reference.values()}) == 3  # the adapters really change the output


async def test_stream_deltas_concatenate_to_the_whole_text(
        engine: VllmEngine, reference: dict[str, list[str]]) -> None:
    deltas, fin = await collect(engine, GenerateRequest(prompt=PROMPTS[0], **GREEDY))
    assert len(deltas) > 1 and all(deltas)
    assert "".join(deltas) == reference[""][0]
    assert fin == Finished("length", fin.prompt_tokens, 16)


async def test_sampling_params_reach_the_engine(engine: VllmEngine, reference: dict[str, list[str]]) -> None:
    full = reference[""][0]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    text, fin = await engine.generate(GenerateRequest(prompt=PROMPTS[0], stop=[stop], **GREEDY))
    assert fin.finish_reason == "stop" and full.startswith(text) and len(text) < len(full)
    short, fin = await engine.generate(GenerateRequest(prompt=PROMPTS[0], max_tokens=3, temperature=0))
    assert fin.completion_tokens == 3 and full.startswith(short)
    sampled = [await engine.generate(GenerateRequest(prompt=PROMPTS[0], max_tokens=16, temperature=1.0,
                                                     top_p=0.9, seed=s)) for s in (1, 1, 2)]
    assert sampled[0][0] == sampled[1][0] != sampled[2][0]  # seeded sampling is reproducible


async def test_chat_messages_get_the_chat_template(engine: VllmEngine, tiny: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = AutoTokenizer.from_pretrained(tiny["base"])
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat, chat_fin = await engine.generate(GenerateRequest(messages=messages, **GREEDY))
    raw, raw_fin = await engine.generate(GenerateRequest(prompt=rendered, **GREEDY))
    plain, _ = await engine.generate(GenerateRequest(prompt=messages[0]["content"], **GREEDY))
    assert chat == raw != plain
    assert chat_fin.prompt_tokens == raw_fin.prompt_tokens == len(tok(rendered, add_special_tokens=False).input_ids)


async def test_runtime_adapter_load_and_unload_without_restart(
        engine: VllmEngine, tiny: dict[str, Path], reference: dict[str, list[str]]) -> None:
    pid = engine.pid
    with pytest.raises(EngineRequestError) as err:
        await engine.generate(GenerateRequest(prompt=PROMPTS[0], adapter="c", **GREEDY))
    assert err.value.status == 404
    await engine.load_adapter("c", tiny["c"])
    text_c, _ = await engine.generate(GenerateRequest(prompt=PROMPTS[0], adapter="c", **GREEDY))
    assert text_c not in (reference[""][0], reference["a"][0], reference["b"][0])
    await engine.unload_adapter("c")
    assert "c" not in engine.loaded_adapters()
    with pytest.raises(EngineRequestError):
        await engine.generate(GenerateRequest(prompt=PROMPTS[0], adapter="c", **GREEDY))
    await engine.load_adapter("c2", tiny["c"])  # a promoted adapter under a new name
    assert (await engine.generate(GenerateRequest(prompt=PROMPTS[0], adapter="c2", **GREEDY)))[0] == text_c
    assert engine.pid == pid and engine.returncode is None


async def test_overlapping_loads_and_unloads_of_one_name_agree_with_the_engine(
        engine: VllmEngine, tiny: dict[str, Path]) -> None:
    """Loads (two paths) and unloads of one name all at once, as an eviction beside a new acquire: none is
    refused as "already loaded", they apply in call order, and the client lists what the engine serves."""
    paths = [tiny["a"], tiny["c"]]
    ops = [engine.load_adapter("d", paths[i // 2 % 2]) if i % 2 == 0 else engine.unload_adapter("d")
           for i in range(11)]
    await asyncio.gather(*ops)  # the last call (i = 10), a load of tiny["c"], wins
    served = {m["id"]: m.get("root") for m in (await engine._require_client().get("/v1/models")).json()["data"]}
    assert "d" in engine.loaded_adapters() and served["d"] == str(tiny["c"])
    await asyncio.gather(engine.load_adapter("d", tiny["c"]), engine.unload_adapter("d"))
    served = {m["id"] for m in (await engine._require_client().get("/v1/models")).json()["data"]}
    assert "d" not in engine.loaded_adapters() and "d" not in served


async def test_concurrent_streams_all_finish(engine: VllmEngine, reference: dict[str, list[str]]) -> None:
    reqs = [GenerateRequest(prompt=PROMPTS[i % 2], adapter=[None, "a", "b"][i % 3], **GREEDY) for i in range(12)]
    results = await asyncio.gather(*(engine.generate(r) for r in reqs))
    assert all(fin.completion_tokens == 16 for _, fin in results)
    stats = await engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and 0 <= stats["kv_cache_usage"] <= 1


async def _wait_idle(engine: VllmEngine) -> dict[str, float]:
    """The engine's stats once nothing runs or waits (an aborted sequence leaves at the next engine step)."""
    async def idle() -> dict[str, float] | None:
        stats = await engine.stats()
        return stats if stats["running"] == 0 and stats["waiting"] == 0 else None

    return await wait_until_async(idle, 30, "the engine running and queueing nothing", poll_s=0.1)


# No retry: the cancelled sequence asks for MAX_MODEL_LEN - 16 tokens (ignore_eos): ~20 s of generation on a 2-core
# box at load 10 (~400 tokens/s measured), seconds on any CPU; the engine went idle 0.15-0.35 s after the request,
# 1-8 tokens in. The race this test once tolerated with a retry (the engine core finishing a 496-token budget before
# a CPU-starved API server saw the disconnect) would need the API server starved for the whole generation.
# Known defect, not a timing race: in one full CI run of 3, both cases saw the engine generate all 8176 tokens
# after the client had closed the stream (the abort never reached vLLM 0.32's engine); in the other runs and
# 9 runs alone it aborted within 1-76 tokens. One cause is fixed (the engine's guard closes a generator that a
# disconnect during a paused write left open: the paused-write test below); until full runs show no recurrence it
# stays a non-strict xfail, visible in every run.
@pytest.mark.xfail(strict=False, reason="a client-side close does not always abort the sequence in vLLM's engine")
@pytest.mark.parametrize("how", ["aclose", "cancel"])
async def test_cancelled_stream_stops_generation_in_the_engine(engine: VllmEngine, how: str) -> None:
    budget = MAX_MODEL_LEN - 16
    rid = f"cancel-{how}-{uuid.uuid4().hex[:8]}"
    req = GenerateRequest(prompt=PROMPTS[0], max_tokens=budget, temperature=0, request_id=rid,
                          extra={"ignore_eos": True})
    before = await _wait_idle(engine)
    got: list[str] = []
    t0 = time.monotonic()
    if how == "aclose":
        items = engine.stream(req)
        async for item in items:
            got.append(item.text if isinstance(item, TextDelta) else "")
            break  # at the first delta
        await items.aclose()
    else:
        first = asyncio.Event()

        async def consume() -> None:
            async for item in engine.stream(req):
                got.append(item.text if isinstance(item, TextDelta) else "")
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    after = await _wait_idle(engine)  # nothing runs any more: the sequence left the engine
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    print(f"\n{how}: {generated} of {budget} tokens generated, idle {time.monotonic() - t0:.2f} s after the start")
    assert got and 0 < generated < budget, "the engine generated the whole budget: nothing was aborted"
    # vllm 0.32 does not count aborts in vllm:request_success_total{finished_reason="abort"}; its log says it,
    # from its own process: wait for the line.
    def abort_logged() -> list[str]:
        return [ln for ln in engine.log_tail(400).splitlines() if rid in ln and "abort" in ln.lower()]

    await wait_until_async(abort_logged, 15, f"the engine logging the abort of {rid}", poll_s=0.2)


# starlette's StreamingResponse and uvicorn exactly as in the vLLM venv, around a generator that streams forever and a
# send that stops completing after its first writes, as a write the server paused for a reader that fell behind does.
# The generator stays reachable (vLLM's does), so only an explicit close ends it: CLOSED before RESPONSE ENDED.
_PAUSED_WRITE_HARNESS = """
import asyncio, sys
import uvicorn
from starlette.responses import StreamingResponse
if sys.argv[2] == "with-guard":
    import lorafleet_vllm_guard  # what the engine's server imports through --middleware
KEPT = []

async def body():
    try:
        while True:
            yield b"x" * 1024
            await asyncio.sleep(0)
    finally:
        print("CLOSED", flush=True)

async def app(scope, receive, send):
    gen = body()
    KEPT.append(gen)
    sent = 0

    async def paused(message):
        nonlocal sent
        await send(message)
        sent += 1
        if sent >= 3:
            await asyncio.Event().wait()  # never completes: the cancel on disconnect lands here

    await StreamingResponse(gen)(scope, receive, paused)
    print("RESPONSE ENDED", flush=True)

uvicorn.run(app, uds=sys.argv[1], log_level="warning", lifespan="off")
"""


async def test_a_disconnect_during_a_paused_write_closes_the_streamed_generator(tmp_path: Path) -> None:
    """Why a client's close sometimes never aborted the sequence in vLLM's engine: the disconnect cancels the response
    where it waits, a paused write, and starlette leaves the generator open (without the guard: no CLOSED). The
    engine's guard module closes it, so vLLM aborts the sequence."""
    await asyncio.to_thread(_paused_write_harness, tmp_path)


def _paused_write_harness(tmp_path: Path) -> None:
    import queue
    import threading

    import httpx

    from lorafleet.testing import wait_until

    assert VENV is not None
    (tmp_path / "support").mkdir()
    run_dir = write_support_files(tmp_path / "support")
    script = tmp_path / "harness.py"
    script.write_text(_PAUSED_WRITE_HARNESS)
    for mode, closes in (("with-guard", True), ("without", False)):
        sock = tmp_path / f"{mode}.sock"
        proc = subprocess.Popen([str(venv_python(VENV)), str(script), str(sock), mode], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": str(run_dir)})
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda out=proc.stdout, q=lines: [q.put(ln.strip()) for ln in out], daemon=True).start()
        try:
            wait_until(sock.exists, 60, f"the harness listening ({mode})")
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=30) as client, \
                    client.stream("GET", "http://harness/") as resp:
                assert next(resp.iter_bytes()).startswith(b"x")
            seen: list[str] = []
            while "RESPONSE ENDED" not in seen:
                seen.append(lines.get(timeout=30))
            assert ("CLOSED" in seen) is closes, (mode, seen)
        finally:
            proc.kill()
            proc.wait()


async def test_requests_without_the_key_are_refused(engine: VllmEngine) -> None:
    import httpx

    assert engine.address.startswith("unix:")
    transport = httpx.AsyncHTTPTransport(uds=engine.address.removeprefix("unix:"))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as anon:
        for method, path in [("GET", "/health"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/v1/load_lora_adapter")]:
            resp = await anon.request(method, path, json={"model": "tiny", "prompt": "x"},
                                      headers={"Authorization": "Bearer wrong"} if path == "/metrics" else None)
            assert resp.status_code == 401, (path, resp.status_code)
    assert oct(os.stat(os.path.dirname(engine.address.removeprefix("unix:"))).st_mode & 0o777) == "0o700"


async def test_engine_that_cannot_start_raises_with_its_log(tmp_path: Path) -> None:
    eng = VllmEngine(EngineConfig(model=str(tmp_path / "no-such-model"), max_model_len=MAX_MODEL_LEN))
    await eng.start()
    try:
        with pytest.raises(EngineDied) as err:
            await eng.wait_ready(timeout=120)
        assert err.value.returncode not in (None, 0) and "no-such-model" in err.value.log_tail
    finally:
        await eng.stop()


_ORPHAN_SCRIPT = """
import asyncio, sys
from lorafleet.sidecar.vllm_engine import EngineConfig, VllmEngine
async def main():
    eng = VllmEngine(EngineConfig(model=sys.argv[1], max_model_len=256, max_lora_rank=8, enforce_eager=True))
    await eng.start()
    await eng.wait_ready(240)
    print("SERVER", eng.pid, eng.address.removeprefix("unix:"), flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


async def test_nothing_outlives_a_killed_worker(tiny: dict[str, Path], tmp_path: Path) -> None:
    """A worker killed with SIGKILL cannot stop its engine: PR_SET_PDEATHSIG must take the tree down."""
    script = tmp_path / "worker.py"
    script.write_text(_ORPHAN_SCRIPT)
    worker = await asyncio.create_subprocess_exec(sys.executable, str(script), str(tiny["base"]),
                                                  stdout=subprocess.PIPE, start_new_session=True)
    server, sock = None, None
    try:
        assert worker.stdout is not None
        line = await asyncio.wait_for(worker.stdout.readline(), 300)
        assert line.startswith(b"SERVER "), line
        server, sock = int(line.split()[1]), Path(line.split()[2].decode())
        os.killpg(server, 0)  # the engine's group is alive
        worker.kill()
        await worker.wait()
        def group_gone() -> bool:
            try:
                os.killpg(server, 0)
            except ProcessLookupError:
                return True
            return False

        await wait_until_async(group_gone, 10, "the engine's processes ending with the worker that started them",
                               poll_s=0.1)
    finally:
        for pgid in (worker.pid, server):
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.killpg(pgid, signal.SIGKILL)  # type: ignore[arg-type]
        with contextlib.suppress(ProcessLookupError):
            await worker.wait()
        if sock is not None:  # the killed worker could not remove its run dir
            shutil.rmtree(sock.parent, ignore_errors=True)


async def test_killed_engine_mid_stream_raises_engine_died(engine: VllmEngine) -> None:
    req = GenerateRequest(prompt=PROMPTS[0], max_tokens=MAX_MODEL_LEN - 16, temperature=0,
                          extra={"ignore_eos": True})
    assert engine.pid is not None
    received = 0
    with pytest.raises(EngineDied) as err:
        async with contextlib.aclosing(engine.stream(req)) as items:
            async for _ in items:
                received += 1
                if received == 1:
                    os.kill(engine.pid, signal.SIGKILL)
    assert received < MAX_MODEL_LEN - 16
    assert err.value.returncode == -signal.SIGKILL
    assert "engine log tail" in str(err.value)
