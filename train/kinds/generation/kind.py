"""The generation task kind: a LoRA on a small causal LM (trl SFT), judged by ROUGE-L against the best baseline.

Registered as `generation` in the entry-point group `lorafleet.tasks`. Its default data is the
statute-heading task (a section's text → its official heading); the task's system prompt is part
of the task and of the bundle, so a served specialist applies it when a request brings none.
Heavy imports (torch, transformers, trl) happen inside the methods.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorafleet.core.tasks import MetricSpec
from lorafleet.train.kinds.generation.headings import HeadingsDataset
from lorafleet.train.kinds.generation.trainer import GenerationTrainConfig
from lorafleet.train.run import KindRun, LoopKind


class GenerationKind(LoopKind):
    """Instruction → short text (statute headings by default), greedy-decoded and scored with ROUGE-L F1."""

    name = "generation"
    capability = "generate"
    bundle_kind = "causal-lm"
    default_runtime = "vllm"
    # ROUGE-L F1 is the headline (as in headline generation); chrF β=2 rewards long copies on short outputs,
    # so it is reported beside it, never gated on. The gate is the best of all baselines (`best_`).
    metrics = MetricSpec(
        objective="dev_rouge_l", direction="maximize", baseline="lead", baseline_label="lead words", label="ROUGE-L",
        table=("test_rouge_l", "best_test_rouge_l", "base_test_rouge_l", "lead_test_rouge_l", "test_chrf",
               "dev_rouge_l"),
        report=("rouge_l", "chrf", "chrf1", "exact_match", "pred_words"),
        gate="best", gate_label="the best baseline (lead, base, k-shot, other base k-shot)",
        beside=("test_chrf", "test_chrf1", "test_exact_match", "test_pred_words"),
        # Scores of the answers only: `pred_words` is their length, which research must not optimise.
        objectives=(("dev_chrf", "maximize"), ("dev_chrf1", "maximize"), ("dev_exact_match", "maximize")),
    )
    config_model = GenerationTrainConfig

    def dataset_key(self, cfg: GenerationTrainConfig) -> str:
        # Inputs are cut with the base's own tokenizer, and its template may come from the config.
        return super().dataset_key(cfg) + f"|{cfg.chat_template}"

    def kind_run(self, cfg: GenerationTrainConfig) -> KindRun:
        from lorafleet.train.kinds.generation.run import GenerationRun

        return GenerationRun(cfg)

    def evaluate(self, cfg: GenerationTrainConfig, dataset: HeadingsDataset, adapter_dir: Path, split: str
                 ) -> dict[str, float]:
        from lorafleet.train.kinds.generation.run import evaluate_generation_adapter

        return evaluate_generation_adapter(cfg, dataset, Path(adapter_dir), split)

    def bundle_details(self, cfg: GenerationTrainConfig) -> dict[str, Any]:
        """What serving needs beside the adapter: the base's description (GGUF digest, dequantised weights),
        the chat template override, the task's system prompt and the generation defaults it was scored with."""
        from lorafleet.models.device import resolve_device
        from lorafleet.train.kinds.generation.causal_lm import describe_base
        from lorafleet.train.kinds.generation.trainer import training_precision

        return {
            "training_precision": training_precision(cfg, resolve_device(cfg.device)),  # on this, the training host
            "base": describe_base(cfg.base_model),
            "chat_template": cfg.chat_template,
            "system_prompt": cfg.data.system_prompt,
            "generation": {"max_tokens": cfg.max_new_tokens, "temperature": 0.0},
        }
