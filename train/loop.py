"""The one training loop every kind runs: seeds, the trainer's callback, progress, per-epoch dev evaluation, test.

A kind supplies its parts as a `KindTrainer` (the data, the model with its adapter, the loss and the
trainer that holds them, its evaluator, the saved artifact); `train_with` does what every kind does alike.
Heavy libraries (torch, transformers) load inside the functions that use them.
"""

from __future__ import annotations

import json
import logging
import resource
import shutil
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from lorafleet.core.progress import StepProgress
from lorafleet.core.tasks import EpochCallback, TrainResult
from lorafleet.train.precision import drop_autocast, float32_forward

log = logging.getLogger("lorafleet.train")


class CostMeter:
    """Wall and CPU seconds since creation, the process's peak RSS, and dollars at a price per hour."""

    def __init__(self, price_per_hour_usd: float) -> None:
        self.price = price_per_hour_usd
        self._wall = time.perf_counter()
        self._cpu = self._cpu_now()

    @staticmethod
    def _cpu_now() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    def read(self) -> dict[str, float]:
        wall = time.perf_counter() - self._wall
        return {
            "wall_s": round(wall, 2),
            "cpu_s": round(self._cpu_now() - self._cpu, 2),
            # ru_maxrss is in KiB on Linux; it is the process's peak, which is the run's peak in a CLI run.
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "usd": round(wall / 3600 * self.price, 5),
        }


def save_peft_adapter(peft_model: Any, adapter_dir: Path, base_model: str) -> Path:
    """Write only the adapter (peft format); record the base as configured, not as this machine's path."""
    adapter_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(adapter_dir))
    cfg_path = adapter_dir / "adapter_config.json"
    if not cfg_path.is_file() or not (adapter_dir / "adapter_model.safetensors").is_file():
        raise RuntimeError(f"saving the adapter to {adapter_dir} did not produce the peft files")
    adapter_cfg = json.loads(cfg_path.read_text())
    adapter_cfg["base_model_name_or_path"] = base_model
    cfg_path.write_text(json.dumps(adapter_cfg, indent=2, sort_keys=True) + "\n")
    return adapter_dir


def check_adapter_dir(adapter_dir: Path) -> Path:
    """`adapter_dir` as a Path; FileNotFoundError unless it holds a peft adapter."""
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter_dir} is not a peft adapter directory (no adapter_config.json)")
    return adapter_dir


def trainable_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class KindTrainer(ABC):
    """One kind's parts of one training run; `train_with` drives them and owns everything else.

    Call order, all in the caller's thread and process:

    1. `prepare(device)` (optional): work that must come before the seed is set (data the loop must not
       perturb the random state for, numbers the result reports).
    2. The loop seeds python, numpy and torch with `seed`.
    3. `trainer(device, out_dir, callbacks)` (required): the model with its adapter, the loss and the
       transformers / sentence-transformers / trl trainer holding them, with `callbacks` installed and
       `output_dir` under `out_dir / ".trainer"` (deleted after training).
    4. `trainer.train()`; after every epoch, when `eval_each_epoch`, `evaluate(model, "dev", epoch)` (required)
       runs at float32 and the loop puts the module back in training mode; then `on_epoch(epoch, dev)`,
       whose exceptions (pruning, a time limit) leave the loop.
    5. Only when asked (a standalone run), `evaluate(model, "test", 0)` once.
    6. `save(model, out_dir)` (required) → the artifact's folder (a peft adapter, or a whole model).
    7. `stats(trainer, timing)` (optional) → further flat metrics (what the kind measures after training, inside
       the run's cost); then `extras()` (optional) → `TrainResult.extras`.

    `model` is the trainer's `model`. `evaluate` returns flat `{split}_{metric}` floats; a kind may keep
    what else it computed (predictions) on `self`. `cfg` is the kind's `train:` section (the loop reads its
    `seed`, `device` and `price_per_hour_usd`), `dataset` the kind's dataset (the loop reads its `digest`).
    """

    progress_label: ClassVar[str] = "train"
    eval_each_epoch: bool = True  # False: no dev evaluation during training (a kind may set it per run)
    log_keys: ClassVar[tuple[str, ...]] = ()  # dev metrics named in each epoch's log line

    def __init__(self, cfg: Any, dataset: Any) -> None:
        self.cfg, self.dataset = cfg, dataset

    def prepare(self, device: str) -> None:
        return None

    @abstractmethod
    def trainer(self, device: str, out_dir: Path, callbacks: list[Any]) -> Any: ...

    @abstractmethod
    def evaluate(self, model: Any, split: str, epoch: int) -> dict[str, float]: ...

    @abstractmethod
    def save(self, model: Any, out_dir: Path) -> Path: ...

    def stats(self, trainer: Any, timing: dict[str, float]) -> dict[str, float]:
        return {}

    def extras(self) -> dict[str, Any]:
        return {}


class EpochLoop:
    """The trainer callback's state: per-step losses, the progress line, timed dev evaluation after each epoch."""

    def __init__(self, kind: KindTrainer, on_epoch: EpochCallback | None) -> None:
        self.kind, self.on_epoch = kind, on_epoch
        self.epochs: list[dict[str, float]] = []
        self.losses: list[tuple[float, float]] = []  # (epoch position, loss)
        self.bar: StepProgress | None = None
        self.t0 = self.c0 = 0.0
        # Seconds of the per-epoch dev evaluations, which run inside trainer.train(); CPU (all threads) beside wall.
        self.eval_s = self.eval_cpu_s = self.train_s = self.train_cpu_s = 0.0

    def callback(self) -> Any:
        from transformers import TrainerCallback

        loop = self

        class _EpochEval(TrainerCallback):  # type: ignore[misc]
            def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                loop.t0, loop.c0 = time.perf_counter(), time.process_time()
                loop.bar = StepProgress(state.max_steps, loop.kind.progress_label)

            def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                       **_: Any) -> None:
                if logs and "loss" in logs:
                    loop.losses.append((float(state.epoch or 0), float(logs["loss"])))
                    if loop.bar is not None:
                        loop.bar.advance(1, f"epoch {len(loop.epochs) + 1} loss {logs['loss']:.4f}")

            def on_epoch_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
                loop.end_epoch(model)

            def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                loop.train_s = time.perf_counter() - loop.t0 - loop.eval_s
                loop.train_cpu_s = time.process_time() - loop.c0 - loop.eval_cpu_s

        return _EpochEval()

    def end_epoch(self, model: Any) -> None:
        epoch = len(self.epochs) + 1
        losses = [v for pos, v in self.losses if epoch - 1 < pos <= epoch + 1e-9]
        row = {"epoch": float(epoch), "train_loss": sum(losses) / len(losses) if losses else float("nan")}
        if not self.kind.eval_each_epoch:
            self.epochs.append(row)
            log.info("epoch %d: train_loss %.4f", epoch, row["train_loss"])
            return
        t0, c0 = time.perf_counter(), time.process_time()
        with float32_forward(model):  # scores compare across training precisions
            dev = self.kind.evaluate(model, "dev", epoch)
        self.eval_s += time.perf_counter() - t0
        self.eval_cpu_s += time.process_time() - c0
        row.update(dev)
        self.epochs.append(row)
        log.info("epoch %d: train_loss %.4f  %s (dev eval %.0f s)", epoch, row["train_loss"],
                 "  ".join(f"{k} {dev[k]:.4f}" for k in self.kind.log_keys if k in dev), time.perf_counter() - t0)
        if self.on_epoch is not None:
            self.on_epoch(epoch, dict(dev))
        model.train()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def timing(self) -> dict[str, float]:
        return {"train_s": round(self.train_s, 2), "train_cpu_s": round(self.train_cpu_s, 2),
                "epoch_eval_s": round(self.eval_s, 2)}


def train_with(kind: KindTrainer, out_dir: Path, *, on_epoch: EpochCallback | None = None, keep_model: bool = False,
               evaluate_test: bool = False) -> TrainResult:
    """Train with `kind`'s parts (see KindTrainer for the order); the artifact lands where `kind.save` puts it.

    `on_epoch(epoch, dev_metrics)` is called after every epoch's dev evaluation (epochs count from 1); whatever it
    raises (e.g. `optuna.TrialPruned`) propagates out of this function and nothing is saved. Test is scored only
    with `evaluate_test` (a standalone run): research trials see dev only, and research scores test once, for its
    winner. Metrics: the last epoch's `dev_*`, `test_*` only with `evaluate_test`, `train_loss`, `trainable_params`,
    the training seconds without the dev evaluations (`train_s`, `train_cpu_s`, `epoch_eval_s`) and
    `kind.stats`. Costs cover this function only. `keep_model` puts the trained model in `extras["model"]`.
    """
    from transformers import PrinterCallback, set_seed

    from lorafleet.models.device import resolve_device

    cfg = kind.cfg
    meter = CostMeter(cfg.price_per_hour_usd)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    kind.prepare(device)
    set_seed(cfg.seed)
    loop = EpochLoop(kind, on_epoch)
    trainer = kind.trainer(device, out_dir, [loop.callback()])
    trainer.remove_callback(PrinterCallback)  # our own progress lines replace its raw dicts
    model = trainer.model
    n_trainable = trainable_params(model)
    try:
        trainer.train()
    finally:
        drop_autocast(model)  # evaluated, saved and handed on at the weights' own dtype
        loop.close()
        shutil.rmtree(out_dir / ".trainer", ignore_errors=True)
    metrics = {k: v for k, v in loop.epochs[-1].items() if k.startswith("dev_")}
    if evaluate_test:
        metrics.update(kind.evaluate(model, "test", 0))
    artifact = kind.save(model, out_dir)
    metrics.update({"train_loss": loop.epochs[-1]["train_loss"], "trainable_params": float(n_trainable),
                    **loop.timing()})
    metrics.update(kind.stats(trainer, loop.timing()))
    extras = {"device": device, **kind.extras(), **({"model": model} if keep_model else {})}
    return TrainResult(adapter_dir=artifact, metrics=metrics, epochs=loop.epochs, cost=meter.read(),
                       dataset_digest=kind.dataset.digest, extras=extras)
