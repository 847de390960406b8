"""The `transformers` runtime: batched `generate` of a causal LM with peft LoRA adapters, in process.

The light fallback to vLLM: no second venv, no engine process; for tests, small deployments and as
the baseline of the benchmark. It runs in the worker's main thread like every batch runtime: the
worker pulls a batch of one (base, adapter) when the main thread is free, this runtime left-pads it
and decodes all of it together. Sequences that sample with different settings (temperature, top-p,
seed) cannot share one `generate` call, so a batch runs as one call per setting (greedy tasks are
one group).

After each decoding step a stopping criterion (`_Steps`) looks at every row: end-of-sequence,
its own `max_tokens`, its stop strings, and whether the worker wants it stopped (client gone,
deadline); finished rows stop early while the others go on. The same pass decodes each row's new
text and hands the delta to the worker, which streams it. The semantics follow vLLM's OpenAI
server: the text excludes the end-of-sequence token and the stop string, special tokens are skipped,
and the completion tokens count the end-of-sequence token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, ValidationError

from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.core.config import BaseModelSpec, ConfigError, StrictModel, format_validation_error
from lorafleet.core.wire import GENERATE
from lorafleet.models.causal import context_length, resolve_causal_source
from lorafleet.models.precision import AUTO, GATED, JudgedModel, ServedPrecision, served_precision
from lorafleet.sidecar.runtime import ABORTED, Generated, GenerateInput, RequestRefused, Runtime, TokenSink

log = logging.getLogger(__name__)

_PREFIX_TOKENS = 4


_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # precision → torch dtype name


class TransformersOptions(StrictModel):
    """`options:` of a base served by the transformers runtime."""

    max_model_len: int | None = Field(None, ge=16, description="Context in tokens; default: the model's own.")
    dtype: str = Field("auto", description="'auto': as `precision` (under `precision: auto`, what the base's "
                       "models were judged at, float32 until known); or a torch dtype name (bfloat16, float16, "
                       "float32).")


class _Row:
    """What one sequence of a running `generate` call has produced so far."""

    __slots__ = ("done", "emitted", "finish", "index", "max_tokens", "prefix", "prefix_text", "stop", "stream", "text",
                 "tokens")

    def __init__(self, index: int, max_tokens: int, stop: tuple[str, ...], stream: bool, prefix: list[int],
                 prefix_text: str) -> None:
        self.index = index
        self.prefix = prefix  # the prompt's last tokens: decoded with the output, they keep its leading space
        self.prefix_text = prefix_text
        self.max_tokens = max_tokens
        self.stop = stop
        self.stream = stream
        self.tokens: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of `text` already handed to the sink
        self.done = False
        self.finish = "length"


class TransformersRuntime(Runtime):
    """The generate capability on a transformers causal LM; adapters through its peft integration (plugin
    name `transformers`)."""

    capabilities: ClassVar[frozenset[str]] = frozenset({GENERATE})

    @classmethod
    def precisions(cls, device: str) -> frozenset[str]:
        from lorafleet.models.precision import supported_precisions

        return supported_precisions(device) - {"int8"}  # the weights' dtype; no quantisation here

    def __init__(self, spec: BaseModelSpec, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            opts = TransformersOptions.model_validate(spec.options)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, f"bases.{spec.name}.options (runtime transformers)")) \
                from exc
        self.spec = spec
        self.device = device
        source = resolve_causal_source(spec.source)
        self.tokenizer = AutoTokenizer.from_pretrained(source, revision=spec.revision)
        if spec.precision != AUTO:
            named = _DTYPE_NAMES[spec.precision]
            if opts.dtype not in ("auto", named):
                raise ConfigError(f"bases.{spec.name}: precision {spec.precision!r} and options.dtype "
                                  f"{opts.dtype!r} disagree; set one of them")
            dtype: Any = getattr(torch, named)
        elif opts.dtype != "auto":
            dtype = getattr(torch, opts.dtype)
        else:  # `auto`: fp32, the gated precision, until use_judged says what the base's models were judged at
            dtype = getattr(torch, _DTYPE_NAMES[GATED])
        self._auto = spec.precision == AUTO and opts.dtype == "auto"
        model = AutoModelForCausalLM.from_pretrained(source, revision=spec.revision, dtype=dtype)
        self.model = model.to(device).eval()
        self.precision = {v: k for k, v in _DTYPE_NAMES.items()}.get(str(model.dtype).removeprefix("torch."),
                                                                     str(model.dtype))
        self.served = ServedPrecision(self.precision, "auto: no served model judged yet, fp32 (the gated precision)"
                                      if self._auto else f"the fleet file sets {self.precision}")
        self.context = context_length(source, spec.options) or 2048
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids = eos_ids
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(eos_ids, default=0)
        self._adapters: list[str] = []
        self._active: str | bool | None = False  # False: unknown
        log.info("loaded causal base %s from %s on %s (context %d)", spec.name, source, device, self.context)

    # -- adapters ------------------------------------------------------------------------------------
    def use_judged(self, models: Collection[JudgedModel], resolve: Callable[[str], Path] | None = None
                   ) -> ServedPrecision:
        """Under `precision: auto`, serve the precision the base's models were judged at (lorafleet.models.precision.
        served_precision): the fp32 weights are cast down once, before adapters load (a cast from fp32 rounds as
        loading at that dtype would). An explicit precision or options.dtype stays as set (an override)."""
        import torch

        declared = AUTO if self._auto else self.precision
        verdict = served_precision(declared, [m.judged for m in models], self.precisions(self.device))
        if self._auto and verdict.precision != self.precision:
            if self.precision != GATED or self._adapters:
                raise RuntimeError("use_judged is for a freshly loaded fp32 base with no adapters")
            self.model.to(getattr(torch, _DTYPE_NAMES[verdict.precision]))
            self.precision = verdict.precision
        self.served = verdict if self._auto or verdict.override else self.served
        log.info("base %s: precision %s (%s)", self.spec.name, self.precision, self.served.reason)
        return self.served

    def load_adapter(self, adapter_id: str, path: str) -> None:
        import warnings

        try:
            with warnings.catch_warnings():
                # peft warns on every second adapter; several adapters on one base is the point here.
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                self.model.load_adapter(path, adapter_name=adapter_id)
        except (ValueError, KeyError, TypeError, OSError) as exc:
            self._forget(adapter_id)
            raise AdapterUnavailable(f"adapter {adapter_id!r} from {path} does not fit base {self.spec.name!r}: "
                                     f"{exc}") from exc
        except BaseException:
            self._forget(adapter_id)
            raise
        self._adapters.append(adapter_id)
        self._active = False

    def _forget(self, adapter_id: str) -> None:
        try:
            self.model.delete_adapter(adapter_id)
        except Exception:
            log.debug("no partial adapter %s to remove", adapter_id)

    def unload_adapter(self, adapter_id: str) -> None:
        if adapter_id in self._adapters:
            self.model.delete_adapter(adapter_id)
            self._adapters.remove(adapter_id)
            self._active = False

    def loaded_adapters(self) -> list[str]:
        return list(self._adapters)

    def _activate(self, adapter_id: str | None) -> None:
        if self._active == adapter_id:
            return
        if adapter_id is None:
            if self._adapters:
                self.model.disable_adapters()
        else:
            if adapter_id not in self._adapters:
                raise KeyError(f"adapter {adapter_id!r} is not loaded on base {self.spec.name!r}")
            self.model.enable_adapters()
            self.model.set_adapter(adapter_id)
        self._active = adapter_id

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, inputs: list[GenerateInput], adapter_id: str | None, sink: TokenSink) -> list[Generated]:
        self._activate(adapter_id)
        prompts = [self.tokenizer(x.prompt, add_special_tokens=not x.params.chat).input_ids for x in inputs]
        for ids in prompts:
            if len(ids) >= self.context:
                raise RequestRefused(f"the prompt has {len(ids)} tokens; the context of {self.spec.name} is "
                                     f"{self.context}")
        groups: dict[tuple[float, float, int | None], list[int]] = {}
        for i, x in enumerate(inputs):
            p = x.params
            key = (0.0, 1.0, None) if p.greedy else (p.temperature, p.top_p, p.seed)
            groups.setdefault(key, []).append(i)
        out: list[Generated | None] = [None] * len(inputs)
        for (temperature, top_p, seed), rows in groups.items():
            for i, g in zip(rows, self._run(inputs, prompts, rows, temperature, top_p, seed, sink), strict=True):
                out[i] = g
        return [g for g in out if g is not None]

    def _run(self, inputs: list[GenerateInput], prompts: list[list[int]], indices: list[int], temperature: float,
             top_p: float, seed: int | None, sink: TokenSink) -> list[Generated]:
        import torch
        from transformers import GenerationConfig, StoppingCriteriaList

        width = max(len(prompts[i]) for i in indices)
        ids = torch.full((len(indices), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(indices), width), dtype=torch.long)
        for r, i in enumerate(indices):  # left padding: every row's next token lands in the same column
            n = len(prompts[i])
            ids[r, width - n:] = torch.tensor(prompts[i])
            mask[r, width - n:] = 1
        rows = []
        for i in indices:
            prefix = prompts[i][-_PREFIX_TOKENS:]
            rows.append(_Row(i, min(inputs[i].params.max_tokens, self.context - len(prompts[i])), inputs[i].params.stop,
                             inputs[i].params.stream, prefix, self.decode(prefix)))
        steps = _Steps(self, rows, width, sink)
        config = GenerationConfig(max_new_tokens=max(r.max_tokens for r in rows), do_sample=temperature > 0,
                                  pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids) or None)
        if temperature > 0:
            config.temperature, config.top_p, config.top_k = temperature, top_p, 0  # no top-k, as vLLM's default
            if seed is not None:
                torch.manual_seed(seed)
        with torch.inference_mode():
            self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                generation_config=config, stopping_criteria=StoppingCriteriaList([steps]))
        steps.finish_all()
        return [Generated(r.text, len(prompts[r.index]), len(r.tokens), r.finish) for r in rows]

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def text_of(self, row: _Row, tokens: list[int]) -> str:
        """The text of a row's output tokens as it reads after its prompt (what vLLM's detokenizer returns:
        a sentencepiece word keeps the space it starts with)."""
        text = self.decode(row.prefix + tokens)
        return text[len(row.prefix_text):] if text.startswith(row.prefix_text) else self.decode(tokens)

    def close(self) -> None:
        self._adapters.clear()
        del self.model
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()


class _Steps:
    """Stopping criterion and streamer in one: called after every decoding step with all rows' tokens."""

    def __init__(self, runtime: TransformersRuntime, rows: list[_Row], prompt_width: int, sink: TokenSink) -> None:
        self.runtime = runtime
        self.rows = rows
        self.width = prompt_width
        self.sink = sink

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        last = input_ids[:, -1].tolist()
        for row, token in zip(self.rows, last, strict=True):
            if row.done:
                continue
            row.tokens.append(token)
            if token in self.runtime.eos_ids:
                self._end(row, "stop", drop_last=True)
            elif self.sink.stopped(row.index):
                self._end(row, ABORTED)
            else:
                self._advance(row)
        return torch.tensor([r.done for r in self.rows], dtype=torch.bool, device=input_ids.device)

    def _advance(self, row: _Row) -> None:
        row.text = self.runtime.text_of(row, row.tokens)
        for stop in row.stop:
            at = row.text.find(stop)
            if at >= 0:
                row.text = row.text[:at]
                self._end(row, "stop")
                return
        if len(row.tokens) >= row.max_tokens:
            self._end(row, "length")
            return
        # Hold back what may still turn into a stop string, and a character whose bytes are incomplete.
        hold = max((len(s) - 1 for s in row.stop), default=0)
        safe = len(row.text) - hold
        if row.text.endswith("\ufffd"):
            safe = min(safe, len(row.text) - 1)
        if row.stream and safe > row.emitted:
            self.sink.delta(row.index, row.text[row.emitted:safe])
            row.emitted = safe

    def _end(self, row: _Row, finish: str, drop_last: bool = False) -> None:
        if drop_last:
            row.text = self.runtime.text_of(row, row.tokens[:-1])
        row.done = True
        row.finish = finish
        if row.stream and len(row.text) > row.emitted:
            self.sink.delta(row.index, row.text[row.emitted:])
            row.emitted = len(row.text)

    def finish_all(self) -> None:
        """Rows that `generate` ended itself (its max_new_tokens) end at their length."""
        for row in self.rows:
            if not row.done:
                self._end(row, "length")
