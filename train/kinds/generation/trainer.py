"""LoRA SFT of a small causal LM with trl, evaluated by generating after every epoch (task: statute headings).

`train_generation` trains one adapter on a `HeadingsDataset`; `train_full` fine-tunes every weight on
the same data (for the bench); `run_generation_train` (in `generation_run`) is the whole run. Loss
is on the assistant turn only: the conversational `messages` become trl's conversational
prompt/completion pairs (prompt = system + user, completion = assistant), and trl masks the prompt
(`completion_only_loss`). trl's `assistant_only_loss` would need `{% generation %}` markers that
SmolLM2's template lacks, and trl has no training template for it. The loss itself is computed by a
thin SFTTrainer subclass that runs the LM head only where a label exists (2× faster on CPU).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from lorafleet.core.config import ConfigError
from lorafleet.core.tasks import EpochCallback, TrainResult
from lorafleet.models.device import resolve_device
from lorafleet.train.dropout import use_fast_dropout
from lorafleet.train.kinds.generation.causal_lm import describe_base, load_causal_base, resolve_dtype
from lorafleet.train.kinds.generation.config import (
    GenerationLoraSettings,
    GenerationTrainConfig,
    load_generation_config,
)
from lorafleet.train.kinds.generation.evaluate import generate_answers, text_metrics
from lorafleet.train.kinds.generation.headings import HeadingsDataset
from lorafleet.train.loop import KindTrainer, save_peft_adapter, train_with, trainable_params
from lorafleet.train.precision import resolve_training_precision

log = logging.getLogger("lorafleet.train")
HEADLINE = "test_rouge_l"  # the deciding metric of this kind (ROUGE-L F1 over words); higher is better
OBJECTIVE = "dev_rouge_l"


def to_prompt_completion(data: Any) -> Any:
    """trl's conversational prompt/completion form of a `messages` dataset: the last message is the completion."""
    return data.map(lambda ex: {"prompt": ex["messages"][:-1], "completion": ex["messages"][-1:]},
                    remove_columns=[c for c in data.column_names if c != "id"])


def assistant_loss(model: Any, tokenizer: Any, conversations: list[list[dict[str, str]]],
                   batch_size: int = 16) -> float:
    """Mean NLL per assistant token of `conversations` (each ending with the assistant turn), deterministic.

    The same yardstick before and after training: the prompt (all but the last message, with the
    generation prompt) is masked, the last turn and the template's tokens after it are scored.
    """
    import torch

    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    with torch.inference_mode():
        for start in range(0, len(conversations), batch_size):
            ids, labels = [], []
            for conv in conversations[start : start + batch_size]:
                prompt = tokenizer.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"]
                full = tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
                if full[: len(prompt)] != prompt:
                    raise ValueError("the chat template does not render the prompt as a prefix of the conversation")
                ids.append(full)
                labels.append([-100] * len(prompt) + full[len(prompt) :])
            width = max(map(len, ids))
            pad = tokenizer.pad_token_id
            input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids], device=device)
            mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids], device=device)
            target = torch.tensor([y + [-100] * (width - len(y)) for y in labels], device=device)
            logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target[:, 1:], reduction="sum")
            total += float(nll)
            count += int((target[:, 1:] != -100).sum())
    if was_training:
        model.train()
    return total / count


def evaluate_split(cfg: GenerationTrainConfig, model: Any, tokenizer: Any, dataset: HeadingsDataset,
                   split: str, description: str) -> tuple[dict[str, float], list[str]]:
    preds = generate_answers(model, tokenizer, dataset.prompts(split), batch_size=cfg.eval_batch_size,
                             max_new_tokens=cfg.max_new_tokens, description=description)
    return text_metrics(preds, dataset.references(split), split), preds


def training_precision(cfg: GenerationTrainConfig, device: str) -> str:
    """'bf16' or 'fp32': what training computes in. `precision` (autocast over float32 weights; ConfigError where
    bf16 is not native), and bf16 whenever `dtype` loads the weights in bfloat16 (CUDA's 'auto')."""
    import torch

    precision = resolve_training_precision(cfg.precision, device)
    return "bf16" if resolve_dtype(device, cfg.dtype) == torch.bfloat16 else precision


def _sft_config(cfg: GenerationTrainConfig, out: Path, device: str, learning_rate: float) -> Any:
    from trl import SFTConfig

    # bf16=True: accelerate autocasts the forward to bf16; float32 weights and the optimizer stay float32.
    bf16 = training_precision(cfg, device) == "bf16"
    return SFTConfig(
        output_dir=str(out), num_train_epochs=cfg.epochs, per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, learning_rate=learning_rate,
        lr_scheduler_type=cfg.lr_scheduler, warmup_steps=cfg.warmup_ratio, weight_decay=cfg.weight_decay,
        max_length=cfg.max_length, packing=cfg.packing, completion_only_loss=True, assistant_only_loss=False,
        train_sampling_strategy="group_by_length" if cfg.group_by_length and not cfg.packing else "random",
        activation_checkpointing=cfg.activation_checkpointing, bf16=bf16, fp16=False, seed=cfg.seed, data_seed=cfg.seed,
        save_strategy="no", eval_strategy="no", logging_strategy="steps", logging_steps=1, report_to="none",
        use_cpu=device == "cpu", disable_tqdm=True, dataloader_num_workers=0, dataset_num_proc=None,
    )


def _train_tokens(trainer: Any) -> int:
    """Tokens of the prepared training set, padding excluded: what one epoch feeds the model."""
    return int(sum(len(ids) for ids in trainer.train_dataset["input_ids"]))


def _dir_mb(path: Path) -> float:
    return round(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6, 3)


def lora_config(cfg: GenerationTrainConfig) -> Any:
    from peft import LoraConfig, TaskType

    targets: Any = "all-linear" if cfg.lora.target_modules == ["all-linear"] else list(cfg.lora.target_modules)
    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                      lora_dropout=cfg.lora.dropout, target_modules=targets)


def _trainer_class() -> type:
    from trl import SFTTrainer

    class CompletionSFTTrainer(SFTTrainer):  # type: ignore[misc]
        """trl's SFTTrainer, with the LM head run only at positions that have a label.

        Without Triton (CPU), trl's fused head scores every position: a 49 k-word head over a ~150-token
        prompt, for ~12 scored tokens. Measured on SmolLM2-135M, batch 8 × 140 tokens, 2 cores: 147–166
        tokens/s that way, 283–380 this way, same loss. Normalised like trl's: by `num_items_in_batch`
        (label tokens over the accumulated batches) when the trainer passes it, else by this batch's.
        """

        def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            import torch.nn.functional as F

            shifted = inputs["labels"][:, 1:]  # logits at position p predict token p + 1
            keep = (shifted != -100).any(0).nonzero().squeeze(1)
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False,
                            logits_to_keep=keep)
            target = shifted[:, keep]
            nll = F.cross_entropy(outputs.logits.float().transpose(1, 2), target, ignore_index=-100, reduction="sum")
            denominator = num_items_in_batch if num_items_in_batch is not None else (target != -100).sum().clamp(min=1)
            loss = nll / denominator
            return (loss, outputs) if return_outputs else loss

    return CompletionSFTTrainer


def build_sft_trainer(cfg: GenerationTrainConfig, dataset: HeadingsDataset, model: Any, tokenizer: Any,
                      out_dir: Path, *, lora: bool = True, learning_rate: float | None = None,
                      callbacks: list[Any] | None = None) -> Any:
    """An SFTTrainer on the training split (prompt/completion, loss on the completion), LoRA or all weights."""
    from transformers import PrinterCallback

    args = _sft_config(cfg, Path(out_dir) / ".trainer", resolve_device(cfg.device),
                       cfg.learning_rate if learning_rate is None else learning_rate)
    try:
        trainer = _trainer_class()(model=model, args=args,
                                   train_dataset=to_prompt_completion(dataset.data["train"]),
                                   processing_class=tokenizer, peft_config=lora_config(cfg) if lora else None,
                                   callbacks=callbacks)
    except ValueError as exc:
        if lora and "target modules" in str(exc).lower():
            raise ConfigError(f"lora.target_modules={cfg.lora.target_modules} do not fit {cfg.base_model}: {exc}") \
                from exc
        raise
    trainer.remove_callback(PrinterCallback)  # our progress replaces its raw dicts
    return trainer


class GenerationTrainer(KindTrainer):
    """The generation kind's parts of the loop: trl SFT (loss on the completion) of a LoRA, or of all weights
    (`lora=False`, the bench's arm), and greedy generation scored with the text metrics. The answers of the last
    dev and test evaluations are kept in `predictions`."""

    log_keys = ("dev_rouge_l", "dev_chrf", "dev_exact_match")

    def __init__(self, cfg: GenerationTrainConfig, dataset: HeadingsDataset, *, lora: bool = True,
                 learning_rate: float | None = None, max_steps: int | None = None, eval_each_epoch: bool = True,
                 final_splits: tuple[str, ...] = ()) -> None:
        super().__init__(cfg, dataset)
        self.lora = lora
        self.learning_rate = cfg.learning_rate if learning_rate is None else learning_rate
        self.max_steps, self.eval_each_epoch, self.final_splits = max_steps, eval_each_epoch, final_splits
        self.precision = "fp32"  # what training computes in (`training_precision`)
        self.tokenizer: Any = None
        self.tokens = 0
        self.predictions: dict[str, list[str]] = {}
        self.artifact: Path | None = None

    def prepare(self, device: str) -> None:
        self.precision = training_precision(self.cfg, device)  # before any work: a bad setting fails now

    def trainer(self, device: str, out_dir: Path, callbacks: list[Any]) -> Any:
        import torch

        cfg = self.cfg
        model, self.tokenizer = load_causal_base(cfg.base_model, device, cfg.dtype, chat_template=cfg.chat_template)
        model.train()
        trainer = build_sft_trainer(cfg, self.dataset, model, self.tokenizer, out_dir, lora=self.lora,
                                    learning_rate=self.learning_rate, callbacks=callbacks)
        if self.max_steps is not None:
            trainer.args.max_steps = self.max_steps
        swapped = use_fast_dropout(trainer.model, device, cfg.dropout_masks)
        self.tokens = _train_tokens(trainer)
        log.info("training %s: %d examples (%d tokens), %d epochs, %d trainable parameters, device %s, %d threads, "
                 "precision %s, dropout masks %s", "LoRA" if self.lora else "all weights", len(trainer.train_dataset),
                 self.tokens, cfg.epochs, trainable_params(trainer.model), device, torch.get_num_threads(),
                 self.precision, "fast" if swapped else "torch")
        return trainer

    def evaluate(self, model: Any, split: str, epoch: int) -> dict[str, float]:
        what = f"dev, epoch {epoch}" if epoch else f"{split}, {'LoRA' if self.lora else 'full'}"
        metrics, self.predictions[split] = evaluate_split(self.cfg, model, self.tokenizer, self.dataset, split, what)
        return metrics

    def save(self, model: Any, out_dir: Path) -> Path:
        if self.lora:
            self.artifact = save_peft_adapter(model, out_dir / "adapter", self.cfg.base_model)
        else:
            self.artifact = out_dir / "model"
            model.save_pretrained(str(self.artifact))
            self.tokenizer.save_pretrained(str(self.artifact))
        return self.artifact

    def stats(self, trainer: Any, timing: dict[str, float]) -> dict[str, float]:
        import torch

        cfg = self.cfg
        steps = trainer.state.global_step
        per_epoch = max(1, math.ceil(len(trainer.train_dataset) / (cfg.batch_size * cfg.gradient_accumulation_steps)))
        seen = self.tokens * min(steps / per_epoch, cfg.epochs)  # max_steps may stop mid-way
        train_s = timing["train_s"]
        out = {"train_examples": float(len(trainer.train_dataset)), "train_tokens_per_epoch": float(self.tokens),
               "train_steps": float(steps),
               "train_tokens_per_s": round(seen / train_s, 1) if train_s > 0 else float("nan"),
               "torch_threads": float(torch.get_num_threads())}
        for split in self.final_splits:  # all-weights training is scored once, at the end
            out.update(self.evaluate(trainer.model, split, 0))
        if self.artifact is not None:
            out["adapter_size_mb" if self.lora else "checkpoint_size_mb"] = _dir_mb(self.artifact)
        return out

    def extras(self) -> dict[str, Any]:
        return {"predictions": dict(self.predictions), "training_precision": self.precision,
                **({"base": describe_base(self.cfg.base_model)} if self.lora else {})}


def train_generation(cfg: GenerationTrainConfig, dataset: HeadingsDataset, out_dir: Path, *,
                     on_epoch: EpochCallback | None = None, keep_model: bool = False,
                     evaluate_test: bool = False) -> TrainResult:
    """A LoRA on `dataset`'s training split, generating on dev after each epoch (the rest as `train_with` says).

    The adapter lands in `out_dir/adapter`; answers on dev (and test) are in `result.extras["predictions"]`;
    `keep_model` puts the trained model and its tokenizer into `result.extras` ("model", "tokenizer")."""
    kind = GenerationTrainer(cfg, dataset)
    result = train_with(kind, out_dir, on_epoch=on_epoch, keep_model=keep_model, evaluate_test=evaluate_test)
    if keep_model:
        result.extras["tokenizer"] = kind.tokenizer
    return result


def train_full(
    cfg: GenerationTrainConfig,
    dataset: HeadingsDataset,
    out_dir: Path,
    *,
    learning_rate: float = 5e-5,
    max_steps: int | None = None,
    evaluate: bool = True,
) -> TrainResult:
    """Fine-tune every weight on the same data and schedule (for the bench); saves the full model.

    Metrics carry `train_tokens_per_s` and `checkpoint_size_mb`; `cost.peak_rss_mb` is the process's
    peak, so run it in a process of its own. `learning_rate` defaults far below LoRA's: all 135 M weights
    move. With `evaluate`, dev and test are generated at the end (not per epoch).
    """
    kind = GenerationTrainer(cfg, dataset, lora=False, learning_rate=learning_rate, max_steps=max_steps,
                             eval_each_epoch=False, final_splits=("dev", "test") if evaluate else ())
    return train_with(kind, out_dir)


__all__ = [
    "HEADLINE", "OBJECTIVE", "GenerationLoraSettings", "GenerationTrainConfig", "assistant_loss", "build_sft_trainer",
    "evaluate_split", "load_generation_config", "lora_config", "to_prompt_completion", "train_full",
    "train_generation",
]
