"""The generative sweep's pure parts: which adapters it applies to, and the recommendation under a TTFT objective."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lorafleet.sidecar.vllm_runtime import VllmOptions
from lorafleet.tune.config import GenerativeTuneConfig
from lorafleet.tune.kinds.generation import kind as generative
from lorafleet.tune.kinds.generation.kind import is_generative
from lorafleet.tune.kinds.generation.probe import GenerativeSweeper
from lorafleet.tune.kinds.generation.result import (
    GenerativeResult,
    cpu_loras_candidates,
    explicit,
    max_loras_candidates,
    normalise,
    recommend,
)
from lorafleet.tune.source import TuneSource


def _result(seqs: int, tps: float, ttft_p99: float | None, errors: int = 0, rss: float = 500.0) -> GenerativeResult:
    return GenerativeResult({"max_num_seqs": seqs}, "seqs", tps, 10.0, ttft_p99, 30.0, 60.0, rss, errors)


def test_recommends_the_fastest_profile_within_the_objective() -> None:
    results = [_result(8, 100, 300), _result(16, 150, 900), _result(32, 170, 2500), _result(64, 200, 100, errors=1)]
    best, meets, reason = recommend(results, 1000.0, None)  # type: ignore[misc]
    assert best.options == {"max_num_seqs": 16} and meets and "≤ 1000 ms" in reason
    best, meets, _ = recommend(results, 1000.0, memory_mb=100.0)  # type: ignore[misc]
    assert best.options == {"max_num_seqs": 8} and not meets  # nothing fits the memory: the lowest TTFT p99
    assert recommend([_result(8, 1, None)], 1000.0, None) is None


def test_only_causal_lm_adapters_get_the_generative_sweep(tmp_path: Path) -> None:
    for task_type, expected in (("CAUSAL_LM", True), ("FEATURE_EXTRACTION", False), (None, False)):
        (tmp_path / "adapter_config.json").write_text(json.dumps({"task_type": task_type}))
        assert is_generative(TuneSource(tmp_path, "base", "base", None, "x")) is expected


# ---- the adapter caches: max_loras / max_cpu_loras under a multi-adapter load ------------------------------------

def test_adapter_cache_sweep_space() -> None:
    cfg = GenerativeTuneConfig(adapters=4, max_loras_grid=[8, 1, 2, 4, 2], cpu_loras_grid=[0.5, 1.0, 2.0])
    assert max_loras_candidates(cfg) == [1, 2, 4]  # 8 slots for 4 adapters would measure nothing new
    assert cpu_loras_candidates(cfg, 1) == [2, 4, 8]
    assert cpu_loras_candidates(cfg, 4) == [4, 8]  # never below max_loras: vLLM refuses that
    alone = cfg.model_copy(update={"adapters": 1})
    assert max_loras_candidates(alone) == [] and cpu_loras_candidates(alone, 1) == []
    assert GenerativeTuneConfig.quick_preset().max_loras_grid == []  # quick: no restarts for the caches


def test_one_spelling_per_engine_and_explicit_recommendation() -> None:
    assert normalise({"max_num_seqs": 8, "max_loras": 2, "max_cpu_loras": 2, "slots": None}) == \
        {"max_num_seqs": 8, "max_loras": 2}  # max_cpu_loras = max_loras is vLLM's default
    assert normalise({"max_loras": 4, "max_cpu_loras": 2}) == {"max_loras": 4}  # less than a step: refused
    assert normalise({"max_loras": 2, "max_cpu_loras": 4}) == {"max_loras": 2, "max_cpu_loras": 4}
    assert explicit({"max_loras": 2}) == {"max_loras": 2, "max_cpu_loras": 2}
    assert explicit({"max_num_seqs": 8})["max_cpu_loras"] == 4  # the runtime's default max_loras


def test_tuning_fleet_serves_several_adapter_ids_and_spreads_the_load(tmp_path: Path) -> None:
    source = TuneSource(tmp_path, "/models/tiny", "tiny", None, "x")
    sweeper = GenerativeSweeper(source, GenerativeTuneConfig(adapters=3), tmp_path / "work", lambda _: None)
    fleet = sweeper.fleet({"max_num_seqs": 8, "max_loras": 2, "max_cpu_loras": 3})
    ids = [m.resolved_adapter_id for m in fleet.models]
    assert len(set(ids)) == 3 and {m.adapter for m in fleet.models} == {str(tmp_path)}
    opts = VllmOptions.of(fleet.bases[0])  # what the worker's engine starts with
    assert (opts.max_loras, opts.max_cpu_loras) == (2, 3)
    assert [sweeper._body(i)["model"] for i in range(4)] == [m.name for m in fleet.models] + [fleet.models[0].name]


class _FakeSweeper:
    """Pure logic of the staged sweep: tokens/s from the options, no cluster (the real one is GenerativeSweeper)."""

    def __init__(self, source: TuneSource, cfg: GenerativeTuneConfig, work_dir: Path, say: object) -> None:
        self.fixed = {"max_model_len": 256, "max_lora_rank": 8}
        self.applied: list[dict[str, object]] = []
        self.precision = "fp32"  # no dev set in these tests: the guard keeps fp32 and generates nothing

    def start(self, options: dict[str, object]) -> None:
        self.applied.append(options)

    def apply(self, options: dict[str, object]) -> float:
        self.applied.append(options)
        return 0.0

    def stop(self) -> None: ...

    def measure(self, options: dict[str, object], phase: str, restart_s: float) -> GenerativeResult:
        loras, cpu = int(options["max_loras"]), int(options.get("max_cpu_loras") or options["max_loras"])  # type: ignore[call-overload]
        # Each slot costs, up to 2 pay back; a cache of every adapter (4) saves rereads: 2 / 4 is the best.
        tps = 100.0 + 10 * min(loras, 2) + 5 * min(cpu, 4) - 8 * loras
        return GenerativeResult(dict(options), phase, tps, 10.0, 100.0, 5.0, 9.0, 400.0 + 20 * cpu)


def test_sweep_visits_the_adapter_caches_and_recommends_them(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generative, "GenerativeSweeper", _FakeSweeper)
    cfg = GenerativeTuneConfig(adapters=4, seqs_grid=[32], batched_tokens_grid=[], kv_cache_gib_grid=[],
                               slots_grid=[], max_loras_grid=[1, 2, 4], cpu_loras_grid=[0.5, 1.0], warmup_s=0)
    source = TuneSource(tmp_path / "adapter", "/models/tiny", "tiny", None, "x")
    result = generative.run_generative_tune(source, cfg, tmp_path / "out", say=lambda _: None)
    seen = [(r.phase, r.options.get("max_loras"), r.options.get("max_cpu_loras")) for r in result.results]
    assert seen == [("baseline", 4, None), ("max_loras", 1, None), ("max_loras", 2, None),
                    ("max_cpu_loras", 2, 4)]  # share 0.5 of 4 = 2 = max_loras: the measured centre itself
    assert result.options["max_loras"] == 2 and result.options["max_cpu_loras"] == 4
    written = yaml.safe_load(result.files["profile"].read_text())
    assert written["options"]["max_cpu_loras"] == 4 and VllmOptions.model_validate(written["options"]).max_loras == 2
    assert "4 adapter id(s) in the load" in result.files["profile"].read_text()


def test_shipping_a_generative_winner_tunes_and_registers_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`research run` on a generation config ends by shipping its winner: the engine sweep (its pure logic here,
    _FakeSweeper), then a registered causal-lm bundle. Shipping once read a precision verdict that only the
    embedding sweep's result carried, so every generative winner failed to ship after its full sweep."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lorafleet import pipeline
    from lorafleet.registry import store
    from lorafleet.research.result import ResearchResult
    from lorafleet.testing import build_tiny_llama
    from lorafleet.train.kinds.generation.config import GenerationTrainConfig

    base = build_tiny_llama(tmp_path / "base")
    torch.manual_seed(0)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    lora.save_pretrained(tmp_path / "adapter")
    train = GenerationTrainConfig.model_validate({"base_model": str(base), "device": "cpu", "lora": {
        "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}})
    client = store.client()
    parent = client.create_run(client.create_experiment("lorafleet-research/gen")).info.run_id
    result = ResearchResult(study="gen", storage="sqlite://", experiment="", parent_run_id=parent,
                            objective="dev_rouge_l", task="generation", winner_trial=0,
                            winner_config=train.model_dump(mode="json"), winner_adapter_dir=str(tmp_path / "adapter"),
                            winner_metrics={"dev_rouge_l": 0.3, "test_rouge_l": 0.3},
                            baseline={"best_dev_rouge_l": 0.1, "best_test_rouge_l": 0.1}, candidate=True)
    monkeypatch.setattr(generative, "GenerativeSweeper", _FakeSweeper)
    monkeypatch.setattr(pipeline, "generation_dev_for", lambda *a, **k: None)  # no dev set: the guard keeps fp32
    shipped = pipeline.ship(result, tune_quick=True, say=lambda _: None)
    assert shipped is not None and shipped.profile_source == "tuned" and shipped.tune_dir is not None
    _, spec = store.bundle_spec("gen", shipped.ref.version)
    assert spec.kind == "causal-lm" and spec.metrics["test_rouge_l"] == 0.3
    assert spec.details["train_config"]["base_model"] == str(base)
    # Issue 39: the guard ran (no dev set: only fp32 qualifies), and the bundle records the precision it was judged at.
    assert spec.precision == "fp32" and spec.details["precision_quality"]["qualified"] is True
