"""The `transformers` generate runtime on the tiny random Llama: batched greedy output equals transformers one
prompt at a time, per-row limits and stop strings, streamed deltas, stopping a row, adapters, refusals."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
from generate_kit import build_tiny, transformers_reference

from lorafleet.core.config import BaseModelSpec
from lorafleet.core.wire import GenerateParams
from lorafleet.sidecar.runtime import ABORTED, GenerateInput, RequestRefused
from lorafleet.sidecar.transformers_runtime import TransformersRuntime

PROMPTS = ["The quick brown fox", "Workers pull tasks from the queue, batch them and reply", "Hello"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_tiny(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def runtime(tiny: dict[str, Path]) -> TransformersRuntime:
    rt = TransformersRuntime(BaseModelSpec(name="tiny", source=str(tiny["base"]), runtime="transformers"), "cpu")
    rt.load_adapter("a", str(tiny["a"]))
    return rt


class Sink:
    def __init__(self, stop_at: dict[int, int] | None = None) -> None:
        self.deltas: dict[int, list[str]] = {}
        self.stop_at = stop_at or {}

    def delta(self, i: int, text: str) -> None:
        self.deltas.setdefault(i, []).append(text)

    def stopped(self, i: int) -> bool:
        return i in self.stop_at and len(self.deltas.get(i, [])) >= self.stop_at[i]


def inputs(max_tokens: int = 12, **kw: Any) -> list[GenerateInput]:
    return [GenerateInput(p, GenerateParams(max_tokens=max_tokens, temperature=0.0, stream=True, **kw))
            for p in PROMPTS]


@pytest.mark.parametrize("adapter", [None, "a"])
def test_a_padded_batch_equals_one_prompt_at_a_time(runtime: TransformersRuntime, tiny: dict[str, Path],
                                                    adapter: str | None) -> None:
    sink = Sink()
    got = runtime.generate(inputs(), adapter, sink)
    expected = transformers_reference(tiny["base"], tiny[adapter] if adapter else None, PROMPTS, 12, True)
    assert [g.text for g in got] == expected
    assert all(g.finish_reason == "length" and g.completion_tokens == 12 for g in got)
    assert ["".join(sink.deltas[i]) for i in range(len(PROMPTS))] == expected  # the stream adds up to the text
    assert got[0].prompt_tokens == len(runtime.tokenizer(PROMPTS[0]).input_ids)


def test_rows_end_on_their_own_limits(runtime: TransformersRuntime) -> None:
    whole = runtime.generate(inputs(), None, Sink())[1].text
    stop = whole[4:7]
    rows = [GenerateInput(PROMPTS[0], GenerateParams(max_tokens=3, temperature=0.0)),
            GenerateInput(PROMPTS[1], GenerateParams(max_tokens=12, temperature=0.0, stop=(stop,), stream=True)),
            GenerateInput(PROMPTS[2], GenerateParams(max_tokens=12, temperature=0.0, stream=True))]
    sink = Sink(stop_at={2: 2})
    got = runtime.generate(rows, None, sink)
    assert got[0].completion_tokens == 3 and got[0].finish_reason == "length"
    assert got[1].finish_reason == "stop" and got[1].text == whole[: whole.index(stop)]
    assert "".join(sink.deltas[1]) == got[1].text  # what might have become the stop string was held back
    assert got[2].finish_reason == ABORTED and got[2].completion_tokens < 12


def test_sampling_groups_and_seeds(runtime: TransformersRuntime) -> None:
    def sample(seed: int) -> str:
        rows = [GenerateInput(PROMPTS[0], GenerateParams(max_tokens=8, temperature=1.0, seed=seed)),
                GenerateInput(PROMPTS[1], GenerateParams(max_tokens=8, temperature=0.0))]
        return runtime.generate(rows, None, Sink())[0].text

    assert sample(1) == sample(1) != sample(2)


def test_adapters_and_refusals(runtime: TransformersRuntime, tiny: dict[str, Path]) -> None:
    from lorafleet.core.adapters import AdapterUnavailable

    base, with_a = (runtime.generate(inputs()[:1], a, Sink())[0].text for a in (None, "a"))
    assert base != with_a
    runtime.load_adapter("b", str(tiny["b"]))
    assert runtime.loaded_adapters() == ["a", "b"]
    runtime.unload_adapter("b")
    assert runtime.generate(inputs()[:1], "a", Sink())[0].text == with_a
    with pytest.raises(AdapterUnavailable):
        runtime.load_adapter("broken", str(tiny["base"]))  # a model folder, not a LoRA
    with pytest.raises(RequestRefused, match="the context of tiny is 512"):
        runtime.generate([GenerateInput("fox " * 600, GenerateParams(max_tokens=4))], None, Sink())
