"""A fourth task kind, `toy-pairs`, built only on the public plugin interface: lorafleet.core.tasks' TaskKind
contract, through the training loop's public bases (lorafleet.train.loop.KindTrainer; lorafleet.train.run.KindRun
and LoopKind, a TaskKind).

Sentence pairs (a sentence's first half → its second half) on a tiny sentence-transformers model, a LoRA
trained with in-batch MNRL, judged by in-batch top-1 accuracy. It records every split it scores in
`LOOKED`, so a test can tell how often it looked at test.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from lorafleet.core.config import StrictModel
from lorafleet.core.tasks import EpochCallback, MetricSpec, TrainResult
from lorafleet.train.loop import KindTrainer, train_with
from lorafleet.train.run import KindRun, LoopKind

# (split, epoch) of every scoring: 1, 2, … after an epoch, 0 the loop's final look, -1 a saved adapter (`evaluate`)
LOOKED: list[tuple[str, int]] = []
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu",
         "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega")


class ToyData(StrictModel):
    pairs: int = Field(24, ge=12)
    seed: int = 0


class ToyConfig(StrictModel):
    base_model: str
    data: ToyData = Field(default_factory=ToyData)
    epochs: int = 2
    learning_rate: float = 1e-2
    batch_size: int = 4
    seed: int = 0
    device: str = "cpu"
    price_per_hour_usd: float = 0.0


class ToyDataset:
    def __init__(self, cfg: ToyConfig) -> None:
        import random

        rng = random.Random(cfg.data.seed)
        rows = [(" ".join(rng.sample(WORDS, 4)), " ".join(rng.sample(WORDS, 4))) for _ in range(cfg.data.pairs)]
        n = len(rows) // 4
        self.splits = {"train": rows[2 * n:], "dev": rows[:n], "test": rows[n:2 * n]}
        self.digest = hashlib.sha256(json.dumps(self.splits).encode()).hexdigest()

    def summary(self) -> dict[str, int]:
        return {f"{split}_pairs": len(rows) for split, rows in self.splits.items()}

    def to_frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame([{"split": s, "query": q, "doc": d} for s, rows in self.splits.items() for q, d in rows])


def top1(model: Any, rows: list[tuple[str, str]], split: str) -> dict[str, float]:
    q = model.encode([r[0] for r in rows], convert_to_tensor=True, normalize_embeddings=True)
    d = model.encode([r[1] for r in rows], convert_to_tensor=True, normalize_embeddings=True)
    hits = (q @ d.T).argmax(1).cpu().tolist()
    return {f"{split}_top1": sum(int(h == i) for i, h in enumerate(hits)) / len(rows)}


def load(cfg: ToyConfig, adapter_dir: Path | None = None) -> Any:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(cfg.base_model, device=cfg.device)
    if adapter_dir is not None:
        model.load_adapter(str(adapter_dir))
    return model


class ToyTrainer(KindTrainer):
    """Only this kind's parts: data, model and LoRA, loss, evaluator, artifact."""

    def trainer(self, device: str, out_dir: Path, callbacks: list[Any]) -> Any:
        from datasets import Dataset
        from peft import LoraConfig, TaskType
        from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

        model = load(self.cfg)
        model.add_adapter(LoraConfig(task_type=TaskType.FEATURE_EXTRACTION, r=4, lora_alpha=8,
                                     target_modules=["query", "value"]))
        rows = self.dataset.splits["train"]
        args = SentenceTransformerTrainingArguments(
            output_dir=str(out_dir / ".trainer"), num_train_epochs=self.cfg.epochs,
            per_device_train_batch_size=self.cfg.batch_size, learning_rate=self.cfg.learning_rate, seed=self.cfg.seed,
            save_strategy="no", eval_strategy="no", logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True)
        model.model_card_data.widget = [{"text": "toy"}]
        data = Dataset.from_dict({"anchor": [r[0] for r in rows], "positive": [r[1] for r in rows]})
        return SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                          loss=MultipleNegativesRankingLoss(model), callbacks=callbacks)

    def evaluate(self, model: Any, split: str, epoch: int) -> dict[str, float]:
        LOOKED.append((split, epoch))
        return top1(model, self.dataset.splits[split], split)

    def save(self, model: Any, out_dir: Path) -> Path:
        model[0].auto_model.save_pretrained(str(out_dir / "adapter"))
        return out_dir / "adapter"


class ToyRun(KindRun):
    task: ClassVar[str] = "toy-pairs"

    def build_dataset(self) -> ToyDataset:
        return ToyDataset(self.cfg)

    def baselines(self, dataset: ToyDataset) -> dict[str, float]:
        model = load(self.cfg)
        return {f"base_{k}": v for split in ("dev", "test")
                for k, v in top1(model, dataset.splits[split], split).items()}

    def train(self, dataset: ToyDataset, out: Path, on_epoch: EpochCallback | None, *,
              evaluate_test: bool) -> TrainResult:
        return train_with(ToyTrainer(self.cfg, dataset), out, on_epoch=on_epoch, evaluate_test=evaluate_test)

    def report(self, path: Path, dataset: ToyDataset, result: TrainResult) -> Path:
        path.write_text(f"# toy pairs\n\ntest top-1 {result.metrics['test_top1']:.3f}\n")
        return path


class ToyKind(LoopKind):
    """Sentence → its other half, judged by in-batch top-1 accuracy."""

    name: ClassVar[str] = "toy-pairs"
    capability: ClassVar[str] = "embed"
    bundle_kind: ClassVar[str] = "sentence-transformers"
    metrics: ClassVar[MetricSpec] = MetricSpec(objective="dev_top1", label="top-1")
    config_model: ClassVar[type[ToyConfig]] = ToyConfig

    def kind_run(self, cfg: ToyConfig) -> KindRun:
        return ToyRun(cfg)

    def evaluate(self, cfg: ToyConfig, dataset: ToyDataset, adapter_dir: Path, split: str) -> dict[str, float]:
        LOOKED.append((split, -1))
        return top1(load(cfg, Path(adapter_dir)), dataset.splits[split], split)
