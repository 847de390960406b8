"""The generation task kind through the user's doors: `lorafleet train` refuses bad input with a clear error and a
non-zero exit, and `research` runs its Optuna loop unchanged (objective dev chrF, tiny random Llama)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from lorafleet.cli import app


def config(base: Path | str, **train: Any) -> dict[str, Any]:
    data = {"laws": ["kschg", "prodhaftg"], "max_train_examples": 16, "max_eval_examples": 6, "input_max_tokens": 48,
            "system_prompt": "Überschrift des Paragraphen."}
    data.update(train.pop("data", {}))
    return {"task": "generation", "train": {
        "base_model": str(base), "data": data, "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "learning_rate": 1e-3, "epochs": 1, "batch_size": 4, "max_new_tokens": 8, "device": "cpu",
        "eval_batch_size": 16, **train}}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorafleet.testing import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny-llama")


def train(tmp_path: Path, cfg: dict[str, Any]) -> Any:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return CliRunner().invoke(app, ["train", str(path), "--no-mlflow", "--out", str(tmp_path / "run")])


def test_bad_input_is_a_clear_error_and_a_nonzero_exit(tmp_path: Path, tiny_llama: Path, tiny_model_dir: Path
                                                       ) -> None:
    from lorafleet.testing import build_tiny_llama

    out = train(tmp_path, {**config(tiny_llama), "task": "chess"})
    assert out.exit_code == 2 and "unknown task kind 'chess'; known: " in out.output and "generation" in out.output

    out = train(tmp_path, config(tiny_model_dir))  # a BERT: not a causal LM
    assert out.exit_code == 2 and "not a causal" in out.output.lower(), out.output

    plain = build_tiny_llama(tmp_path / "plain", chat_template=None)
    out = train(tmp_path, config(plain))
    assert out.exit_code == 2 and "no chat template; set train.chat_template" in out.output, out.output

    out = train(tmp_path, config(tiny_llama, data={"system_prompt": "sehr lange Anweisung " * 40,
                                                   "system_prompt_max_tokens": 16}))
    assert out.exit_code == 2 and "over system_prompt_max_tokens=16" in out.output, out.output
    assert not (tmp_path / "run" / "adapter").exists()


@pytest.mark.integration
def test_research_drives_the_generation_kind(tmp_path: Path, tiny_llama: Path) -> None:
    from lorafleet.research.config import load_config
    from lorafleet.research.runner import run_research

    cfg = config(tiny_llama)
    cfg["research"] = {"study": "headings", "n_trials": 2, "budget_minutes": 10, "trial_timeout_minutes": 5,
                       "sampler": {"kind": "random", "seed": 1}, "pruner": {"kind": "none"}, "reseed": False,
                       "min_margin": 0.0, "heartbeat_s": 1, "grace_s": 30,
                       "space": {"learning_rate": {"type": "float", "low": 5e-4, "high": 2e-3, "log": True}}}
    path = tmp_path / "research.yaml"
    path.write_text(yaml.safe_dump(cfg))
    loaded = load_config(path)
    assert loaded.task == "generation" and loaded.objective == "dev_rouge_l"
    result = run_research(loaded, progress_live=False)
    assert result.finalized and result.task == "generation" and result.trials.get("complete") == 2
    assert {"base_test_chrf", "lead_test_chrf", "base_dev_chrf"} <= set(result.baseline)
    assert "test_chrf" in result.winner_metrics and result.winner_adapter_dir
    assert (Path(result.winner_adapter_dir) / "adapter_config.json").is_file()
    assert result.verdict.startswith(("candidate", "no candidate"))
