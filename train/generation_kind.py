"""The generation task kind: a LoRA on a small causal LM (trl SFT), judged by ROUGE-L against the best baseline.

Registered as `generation` in the entry-point group `lorafleet.tasks`. Its default data is the
statute-heading task (a section's text → its official heading); the task's system prompt is part
of the task and of the bundle, so a served specialist applies it when a request brings none.
Heavy imports (torch, transformers, trl) happen inside the methods.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from lorafleet.tasks import EpochCallback, MetricSpec, TaskKind, TrainResult
from lorafleet.train.generation import GenerationTrainConfig
from lorafleet.train.headings import HeadingsDataset


class GenerationKind(TaskKind):
    """Instruction → short text (statute headings by default), greedy-decoded and scored with ROUGE-L F1."""

    name: ClassVar[str] = "generation"
    capability: ClassVar[str] = "generate"
    bundle_kind: ClassVar[str] = "causal-lm"
    default_runtime: ClassVar[str] = "vllm"
    # ROUGE-L F1 is the headline (as in headline generation); chrF β=2 rewards long copies on short outputs,
    # so it is reported beside it, never gated on. The gate is the best of all baselines (`best_`).
    metrics: ClassVar[MetricSpec] = MetricSpec(
        objective="dev_rouge_l", direction="maximize", baseline="lead", baseline_label="lead words", label="ROUGE-L",
        table=("test_rouge_l", "best_test_rouge_l", "base_test_rouge_l", "lead_test_rouge_l", "test_chrf",
               "dev_rouge_l"),
        report=("rouge_l", "chrf", "chrf1", "exact_match", "pred_words"),
        gate="best", gate_label="the best baseline (lead, base, k-shot, other base k-shot)",
        beside=("test_chrf", "test_chrf1", "test_exact_match", "test_pred_words"),
        # Scores of the answers only: `pred_words` is their length, which research must not optimise.
        objectives=(("dev_chrf", "maximize"), ("dev_chrf1", "maximize"), ("dev_exact_match", "maximize")),
    )
    config_model: ClassVar[type[GenerationTrainConfig]] = GenerationTrainConfig

    def dataset_key(self, cfg: GenerationTrainConfig) -> str:
        # Inputs are cut with the base's own tokenizer, and its template may come from the config.
        return super().dataset_key(cfg) + f"|{cfg.chat_template}"

    def build_dataset(self, cfg: GenerationTrainConfig) -> HeadingsDataset:
        from lorafleet.train.generation_run import build_generation_dataset

        return build_generation_dataset(cfg)

    def baselines(self, cfg: GenerationTrainConfig, dataset: HeadingsDataset) -> dict[str, float]:
        from lorafleet.train.generation_run import generation_baselines

        return generation_baselines(cfg, dataset).metrics

    def train(self, cfg: GenerationTrainConfig, dataset: HeadingsDataset, out_dir: Path, *,
              on_epoch: EpochCallback | None = None) -> TrainResult:
        from lorafleet.train.generation import train_generation

        return train_generation(cfg, dataset, out_dir, on_epoch=on_epoch)

    def evaluate(self, cfg: GenerationTrainConfig, dataset: HeadingsDataset, adapter_dir: Path, split: str
                 ) -> dict[str, float]:
        from lorafleet.train.generation_run import evaluate_generation_adapter

        return evaluate_generation_adapter(cfg, dataset, Path(adapter_dir), split)

    def run(self, cfg: GenerationTrainConfig, out_dir: Path | None = None, *, log_mlflow: bool = True,
            run_name: str | None = None) -> TrainResult:
        from lorafleet.train.generation_run import run_generation_train

        return run_generation_train(cfg, out_dir, log_mlflow=log_mlflow, run_name=run_name)

    def bundle_details(self, cfg: GenerationTrainConfig) -> dict[str, Any]:
        """What serving needs beside the adapter: the base's description (GGUF digest, dequantised weights),
        the chat template override, the task's system prompt and the generation defaults it was scored with."""
        from lorafleet.device import resolve_device
        from lorafleet.train.causal_lm import describe_base
        from lorafleet.train.generation import training_precision

        return {
            "training_precision": training_precision(cfg, resolve_device(cfg.device)),  # on this, the training host
            "base": describe_base(cfg.base_model),
            "chat_template": cfg.chat_template,
            "system_prompt": cfg.data.system_prompt,
            "generation": {"max_tokens": cfg.max_new_tokens, "temperature": 0.0},
        }
