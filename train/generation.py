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
import shutil
import time
from pathlib import Path
from typing import Any

from lorafleet.config import ConfigError
from lorafleet.device import resolve_device
from lorafleet.tasks import EpochCallback, TrainResult
from lorafleet.train.causal_lm import describe_base, load_causal_base, resolve_dtype
from lorafleet.train.config import resolve_training_precision
from lorafleet.train.dropout import use_fast_dropout
from lorafleet.train.generation_config import GenerationLoraSettings, GenerationTrainConfig, load_generation_config
from lorafleet.train.generation_eval import StepProgress, generate_answers, text_metrics
from lorafleet.train.headings import HeadingsDataset
from lorafleet.train.trainer import CostMeter, drop_autocast, float32_forward, save_peft_adapter

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


class _Loop:
    """Callback state: per-step losses, progress, eval seconds inside training, per-epoch dev evaluation."""

    def __init__(self, cfg: GenerationTrainConfig, dataset: HeadingsDataset, tokenizer: Any,
                 on_epoch: EpochCallback | None, eval_each_epoch: bool) -> None:
        self.cfg, self.dataset, self.tokenizer = cfg, dataset, tokenizer
        self.on_epoch, self.eval_each_epoch = on_epoch, eval_each_epoch
        self.epochs: list[dict[str, float]] = []
        self.losses: list[tuple[float, float]] = []  # (epoch position, loss)
        self.t0 = self.eval_s = self.train_s = 0.0
        self.c0 = self.eval_cpu_s = self.train_cpu_s = 0.0  # CPU seconds (all threads), beside the wall seconds
        self.last_dev: tuple[dict[str, float], list[str]] | None = None
        self.bar: StepProgress | None = None
        self.precision = "fp32"  # what training computes in (`training_precision`)

    def callback(self) -> Any:
        from transformers import TrainerCallback

        loop = self

        class _Callback(TrainerCallback):  # type: ignore[misc]
            def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                loop.t0, loop.c0 = time.perf_counter(), time.process_time()
                loop.bar = StepProgress(state.max_steps, "train")

            def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                       **_: Any) -> None:
                if logs and "loss" in logs:
                    loop.losses.append((float(state.epoch or 0), float(logs["loss"])))
                    if loop.bar is not None:
                        loop.bar.advance(1, f"loss {logs['loss']:.3f}")

            def on_epoch_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
                loop.end_epoch(model)

            def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                loop.train_s = time.perf_counter() - loop.t0 - loop.eval_s
                loop.train_cpu_s = time.process_time() - loop.c0 - loop.eval_cpu_s
                if loop.bar is not None:
                    loop.bar.close()

        return _Callback()

    def end_epoch(self, model: Any) -> None:
        epoch = len(self.epochs) + 1
        losses = [v for pos, v in self.losses if epoch - 1 < pos <= epoch + 1e-9]
        row = {"epoch": float(epoch), "train_loss": sum(losses) / len(losses) if losses else float("nan")}
        if self.eval_each_epoch:
            t0, c0 = time.perf_counter(), time.process_time()
            with float32_forward(model):  # scores compare across training precisions
                dev, preds = evaluate_split(self.cfg, model, self.tokenizer, self.dataset, "dev",
                                            f"dev, epoch {epoch}")
            self.eval_s += time.perf_counter() - t0
            self.eval_cpu_s += time.process_time() - c0
            self.last_dev = (dev, preds)
            row.update(dev)
            log.info("epoch %d: train_loss %.4f  dev_rouge_l %.4f  dev_chrf %.2f  dev_exact_match %.3f  "
                     "(dev eval %.0f s)",
                     epoch, row["train_loss"], dev["dev_rouge_l"], dev["dev_chrf"], dev["dev_exact_match"],
                     time.perf_counter() - t0)
            self.epochs.append(row)
            if self.on_epoch is not None:
                self.on_epoch(epoch, dict(dev))
        else:
            self.epochs.append(row)
            log.info("epoch %d: train_loss %.4f", epoch, row["train_loss"])


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


def _run_sft(cfg: GenerationTrainConfig, dataset: HeadingsDataset, out_dir: Path, *, lora: bool,
             on_epoch: EpochCallback | None, learning_rate: float, max_steps: int | None,
             evaluate: bool) -> tuple[Any, Any, Any, _Loop, dict[str, float]]:
    import torch
    from transformers import set_seed

    device = resolve_device(cfg.device)
    precision = training_precision(cfg, device)  # before any work: a bad setting fails now
    set_seed(cfg.seed)
    model, tokenizer = load_causal_base(cfg.base_model, device, cfg.dtype, chat_template=cfg.chat_template)
    model.train()
    loop = _Loop(cfg, dataset, tokenizer, on_epoch, evaluate)
    loop.precision = precision
    trainer = build_sft_trainer(cfg, dataset, model, tokenizer, out_dir, lora=lora, learning_rate=learning_rate,
                                callbacks=[loop.callback()])
    if max_steps is not None:
        trainer.args.max_steps = max_steps
    trained = trainer.model
    swapped = use_fast_dropout(trained, device, cfg.dropout_masks)
    n_trainable = sum(p.numel() for p in trained.parameters() if p.requires_grad)
    tokens = _train_tokens(trainer)
    log.info("training %s: %d examples (%d tokens), %d epochs, %d trainable parameters, device %s, %d threads, "
             "precision %s, dropout masks %s", "LoRA" if lora else "all weights", len(trainer.train_dataset), tokens,
             cfg.epochs, n_trainable, device, torch.get_num_threads(), precision, "fast" if swapped else "torch")
    try:
        trainer.train()
    finally:
        drop_autocast(trained)  # evaluated, saved and handed on at the weights' own dtype
        if loop.bar is not None:  # an exception from on_epoch skips on_train_end
            loop.bar.close()
        shutil.rmtree(out_dir / ".trainer", ignore_errors=True)
    steps = trainer.state.global_step
    steps_per_epoch = max(1, math.ceil(len(trainer.train_dataset) / (cfg.batch_size * cfg.gradient_accumulation_steps)))
    seen = tokens * min(steps / steps_per_epoch, cfg.epochs)  # max_steps may stop mid-way
    stats = {
        "train_examples": float(len(trainer.train_dataset)), "train_tokens_per_epoch": float(tokens),
        "trainable_params": float(n_trainable), "train_steps": float(steps), "train_s": round(loop.train_s, 2),
        "train_cpu_s": round(loop.train_cpu_s, 2),
        "train_tokens_per_s": round(seen / loop.train_s, 1) if loop.train_s > 0 else float("nan"),
        "epoch_eval_s": round(loop.eval_s, 2), "torch_threads": float(torch.get_num_threads()),
    }
    return trained, tokenizer, trainer, loop, stats


def train_generation(
    cfg: GenerationTrainConfig,
    dataset: HeadingsDataset,
    out_dir: Path,
    *,
    on_epoch: EpochCallback | None = None,
    keep_model: bool = False,
    evaluate_test: bool = False,
) -> TrainResult:
    """Train a LoRA adapter on `dataset`'s training split; generate on dev after each epoch.

    `on_epoch(epoch, dev_metrics)` is called after every epoch's dev evaluation (epochs count from 1);
    whatever it raises (e.g. `optuna.TrialPruned`) propagates out of this function, and no adapter is
    saved. The adapter lands in `out_dir/adapter`. Costs cover this function only. `keep_model` puts the
    trained model and its tokenizer into `result.extras` ("model", "tokenizer"); predictions on dev (and
    test) are in `result.extras["predictions"]`. Test is decoded only with `evaluate_test` (a standalone run
    or the bench): research trials see dev only, and research scores test once, for its winner.
    """
    meter = CostMeter(cfg.price_per_hour_usd)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer, _, loop, stats = _run_sft(cfg, dataset, out_dir, lora=True, on_epoch=on_epoch,
                                                learning_rate=cfg.learning_rate, max_steps=None, evaluate=True)
    assert loop.last_dev is not None
    metrics = {**stats, **loop.last_dev[0]}  # the last epoch's dev evaluation is the final model's
    predictions = {"dev": loop.last_dev[1]}
    if evaluate_test:
        test, predictions["test"] = evaluate_split(cfg, model, tokenizer, dataset, "test", "test, LoRA")
        metrics.update(test)
    adapter_dir = save_peft_adapter(model, out_dir / "adapter", cfg.base_model)
    metrics["adapter_size_mb"] = _dir_mb(adapter_dir)
    extras: dict[str, Any] = {"device": resolve_device(cfg.device), "predictions": predictions,
                              "base": describe_base(cfg.base_model), "training_precision": loop.precision}
    if keep_model:
        extras.update(model=model, tokenizer=tokenizer)
    return TrainResult(adapter_dir=adapter_dir, metrics=metrics, epochs=loop.epochs, cost=meter.read(),
                       dataset_digest=dataset.digest, extras=extras)


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
    meter = CostMeter(cfg.price_per_hour_usd)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer, _, loop, stats = _run_sft(cfg, dataset, out_dir, lora=False, on_epoch=None,
                                                learning_rate=learning_rate, max_steps=max_steps, evaluate=False)
    metrics = dict(stats)
    predictions: dict[str, list[str]] = {}
    if evaluate:
        for split in ("dev", "test"):
            m, predictions[split] = evaluate_split(cfg, model, tokenizer, dataset, split, f"{split}, full")
            metrics.update(m)
    ckpt = out_dir / "model"
    model.save_pretrained(str(ckpt))
    tokenizer.save_pretrained(str(ckpt))
    metrics["checkpoint_size_mb"] = _dir_mb(ckpt)
    return TrainResult(adapter_dir=ckpt, metrics=metrics, epochs=loop.epochs, cost=meter.read(),
                       dataset_digest=dataset.digest,
                       extras={"device": resolve_device(cfg.device), "predictions": predictions,
                               "training_precision": loop.precision})


__all__ = [
    "HEADLINE", "OBJECTIVE", "GenerationLoraSettings", "GenerationTrainConfig", "assistant_loss", "build_sft_trainer",
    "evaluate_split", "load_generation_config", "lora_config", "to_prompt_completion", "train_full",
    "train_generation",
]
