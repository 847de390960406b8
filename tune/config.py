"""The settings of a serving-profile sweep (`lorafleet tune`), and the error it raises."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lorafleet.core.config import StrictModel


class TuneError(RuntimeError):
    """The sweep cannot run (bad input, the cluster did not start); the message says what to fix."""


class TuneConfig(StrictModel):
    slo_p99_ms: float = Field(250.0, gt=0, description="Latency objective: p99 at the offered load.")
    memory_gb: float | None = Field(None, gt=0, description="Peak worker memory limit (RSS, GiB).")
    quick: bool = Field(False, description="Three profiles, short load points: well under a minute.")
    concurrencies: list[int] = Field(default_factory=lambda: [1, 8, 32], min_length=1)
    open_fractions: list[float] = Field(default_factory=lambda: [0.5, 0.8], min_length=1,
                                        description="Open-loop rates as fractions of the baseline's capacity.")
    point_s: float = Field(2.5, gt=0, description="Seconds per load point.")
    warmup_s: float = Field(1.0, ge=0)
    min_open_requests: int = Field(30, ge=1, description="An open-loop point lasts long enough for this many "
                                   "arrivals (at most 3 × point_s), so its p99 rests on more than a handful.")
    items_grid: list[int] = Field(default_factory=lambda: [1, 4, 8, 16, 32, 64], min_length=1)
    wait_grid: list[float] = Field(default_factory=lambda: [0.0, 8.0])
    inflight_grid: list[int] = Field(default_factory=lambda: [0, 1, 2])
    tokens_per_item_grid: list[int] = Field(default_factory=lambda: [24, 96],
                                            description="max_batch_tokens = items × this.")
    plateau_gain: float = Field(0.03, ge=0, description="A larger batch must add this much throughput.")
    plateau_patience: int = Field(1, ge=1)
    max_profiles: int = Field(12, ge=1)
    budget_s: float = Field(300.0, gt=0, description="Stop starting new profiles after this long.")
    seed: int = 0
    device: str = "auto"
    slo_ttft_p99_ms: float = Field(2000.0, gt=0, description="Generative specialists: the objective on time to first "
                                   "token (p99) of their sweep (GenerativeTuneConfig).")
    precisions: list[Literal["fp32", "bf16", "fp16", "int8"]] | Literal["auto"] = Field(
        "auto", description="Precisions of the base to sweep (fp32, the reference, always runs); auto: every one the "
        "runtime supports on the device.")
    precision_max_loss: float = Field(0.005, ge=0, description="Quality guard: the most relative loss of the dev "
                                      "set's nDCG@10 against fp32 a precision may have (0.005 = 0.5 %).")
    precision_min_cosine: float = Field(0.999, ge=-1, le=1, description="Quality guard: the least cosine between any "
                                        "vector and fp32's.")
    precision_profiles: int = Field(3, ge=1, description="Each qualifying precision other than fp32 re-measures this "
                                    "many of the best fp32 profiles (they count towards max_profiles).")
    # Rerankers (a cross-encoder's LoRA, score.py): the load is rerank requests, throughput is counted in pairs.
    rerank_documents: int = Field(50, ge=1, le=1000, description="Rerankers: documents per request (1 query × "
                                  "this many, the typical rerank depth).")
    slo_rerank_p99_ms: float = Field(2000.0, gt=0, description="Rerankers: the objective on a whole request's p99 "
                                     "(all its pairs scored).")
    rerank_concurrencies: list[int] = Field(default_factory=lambda: [1, 8], min_length=1,
                                            description="Rerankers: closed-loop concurrencies (8: the benchmark's).")
    rerank_tokens_grid: list[int] = Field(default_factory=lambda: [2048, 8192, 16384],
                                          description="Rerankers: max_batch_tokens, the padded pair tokens of one "
                                          "forward pass and of one batch (pairs per call ≈ this / pair length).")
    rerank_items_grid: list[int] = Field(default_factory=lambda: [1, 2, 4, 8], description="Rerankers: "
                                         "max_batch_items, the tasks (chunks of gateway.rerank_chunk documents) "
                                         "one batch may join.")

    @classmethod
    def quick_preset(cls, **overrides: object) -> TuneConfig:
        base: dict[str, object] = dict(quick=True, concurrencies=[8], open_fractions=[0.6], point_s=1.2,
                                       warmup_s=0.3, items_grid=[1, 8], wait_grid=[], inflight_grid=[],
                                       min_open_requests=15, tokens_per_item_grid=[], max_profiles=3, budget_s=45.0,
                                       precision_profiles=1, rerank_tokens_grid=[16384], rerank_items_grid=[],
                                       rerank_concurrencies=[8])
        base.update(overrides)
        return cls(**base)


class GenerativeTuneConfig(StrictModel):
    """The sweep of a generative specialist's serving profile: the engine options of its base (vllm runtime)."""

    slo_ttft_p99_ms: float = Field(2000.0, gt=0, description="Latency objective: time to first token, p99, at the "
                                   "highest concurrency.")
    memory_gb: float | None = Field(None, gt=0, description="Peak memory limit of the worker and its engine (GiB).")
    quick: bool = False
    concurrencies: list[int] = Field(default_factory=lambda: [1, 32], min_length=1)
    point_s: float = Field(15.0, gt=0)
    warmup_s: float = Field(5.0, ge=0)
    max_tokens: int = Field(64, ge=1, description="Output tokens per request (greedy).")
    max_model_len: int = Field(2048, ge=64)
    seqs_grid: list[int] = Field(default_factory=lambda: [8, 16, 32, 64], min_length=1,
                                 description="max_num_seqs: sequences the engine decodes at once.")
    batched_tokens_grid: list[int] = Field(default_factory=lambda: [512, 8192],
                                           description="max_num_batched_tokens: tokens per engine step.")
    kv_cache_gib_grid: list[int] = Field(default_factory=lambda: [2], description="CPU: KV-cache GiB.")
    gpu_memory_grid: list[float] = Field(default_factory=lambda: [0.6, 0.9], description="CUDA: memory share.")
    slots_grid: list[float] = Field(default_factory=lambda: [0.75, 1.25],
                                    description="The worker's slot target, as a share of max_num_seqs.")
    adapters: int = Field(4, ge=1, le=64, description="Adapter ids in the load: the specialist's adapter and "
                          "copies of it under other ids, requests spread evenly over them, so the engine holds "
                          "several LoRAs as a fleet of one base does; 1 = the specialist alone.")
    max_loras_grid: list[int] = Field(default_factory=lambda: [1, 2, 4], description="max_loras: adapters in one "
                                      "engine step (values above `adapters` are skipped).")
    cpu_loras_grid: list[float] = Field(default_factory=lambda: [0.5, 1.0], description="max_cpu_loras: adapters "
                                        "cached in host memory, as a share of `adapters` (at least max_loras).")
    plateau_gain: float = Field(0.03, ge=0)
    max_profiles: int = Field(12, ge=1, description="Each restarts the engine (~30 s on a CPU) and runs every "
                              "concurrency.")
    budget_s: float = Field(1200.0, gt=0)
    seed: int = 0
    device: str = "auto"
    precisions: list[Literal["fp32", "bf16", "fp16"]] | Literal["auto"] = Field(
        "auto", description="Precisions the engine may serve the base at (fp32, the reference, always runs); auto: "
        "every one the vllm runtime supports on the device. Each is judged on the dev set first (generation_guard).")
    precision_max_loss: float = Field(0.005, ge=0, description="Quality guard: the most relative loss of the dev "
                                      "set's ROUGE-L against fp32 a precision may have (0.005 = 0.5 %), as the "
                                      "retrieval guard's on nDCG@10.")
    guard_concurrency: int = Field(8, ge=1, description="Dev prompts in flight while the guard generates.")

    @classmethod
    def quick_preset(cls, **overrides: object) -> GenerativeTuneConfig:
        base: dict[str, object] = dict(quick=True, concurrencies=[8], point_s=5.0, warmup_s=2.0, max_tokens=32,
                                       seqs_grid=[8, 16], batched_tokens_grid=[], kv_cache_gib_grid=[],
                                       gpu_memory_grid=[], slots_grid=[], max_loras_grid=[], cpu_loras_grid=[],
                                       max_profiles=2, budget_s=300.0)
        base.update(overrides)
        return cls(**base)
