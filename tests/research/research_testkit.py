"""Helpers for the research tests (a uniquely named module, imported by conftest and the tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

def tiny_config(model_dir: Path, study: str, **research: Any) -> dict[str, Any]:
    """Trials of a few seconds: one short law, few queries, tiny LoRA, 1–2 epochs, CPU."""
    cfg: dict[str, Any] = {
        "train": {
            "base_model": str(model_dir),
            "data": {"laws": ["prodhaftg"], "max_train_queries": 12, "max_eval_queries": 8, "hard_negatives": False},
            "lora": {"r": 2, "alpha": 4, "dropout": 0.0, "target_modules": ["query", "value"]},
            "epochs": 1, "batch_size": 4, "max_seq_length": 64, "device": "cpu", "eval_batch_size": 64,
            "learning_rate": 1e-3,
        },
        "research": {
            "study": study,
            "n_trials": 3,
            "budget_minutes": 10,
            "trial_timeout_minutes": 3,
            "sampler": {"kind": "random", "seed": 2},
            # Deterministic pruning: a 3-epoch trial is pruned at epoch 2 (no nDCG reaches 2.0); 1-epoch trials
            # finish (a trial is never pruned after its last epoch).
            "pruner": {"kind": "threshold", "lower": 2.0, "n_warmup_steps": 2},
            "space": {
                "epochs": {"type": "categorical", "choices": [1, 3]},
                "learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
            },
            "min_margin": 0.0,
            "reseed": True,
            "heartbeat_s": 1,
            "grace_s": 30,
        },
    }
    cfg["research"].update(research)
    return cfg


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")})
    return env


def start_cli(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`lorafleet …` in its own process (same interpreter), output to `log`."""
    out = log.open("wb")
    return subprocess.Popen([sys.executable, "-m", "lorafleet.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                            env=cli_env(), cwd=REPO)


def storage_url(home: Path) -> str:
    return f"sqlite:///{home / 'optuna' / 'optuna.db'}"
