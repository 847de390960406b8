"""The default generation recipe: the config file and the code defaults agree, the schedule reaches the trainer,
the loss is on the heading only (the completion), the research space takes the knobs the ablation ranked, and
every ablation arm of `bench/train_generation.py` is a valid config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from lorafleet.train.kinds.generation.headings import HeadingsDataConfig, build_headings
from lorafleet.train.kinds.generation.trainer import GenerationTrainConfig, build_sft_trainer, load_generation_config

REPO = Path(__file__).resolve().parents[2]
HEADINGS = REPO / "configs" / "german-legal-headings.yaml"
RECIPE = ("learning_rate", "epochs", "lr_scheduler", "warmup_ratio", "batch_size", "max_length", "packing",
          "base_model")


def test_the_config_file_is_the_default_recipe() -> None:
    # `lorafleet train` with no file and the shipped file must train the same recipe.
    shipped, default = load_generation_config(HEADINGS), GenerationTrainConfig()
    for name in RECIPE:
        assert getattr(shipped, name) == getattr(default, name), name
    assert shipped.lora == default.lora
    assert shipped.data == HeadingsDataConfig() == default.data


def test_the_research_space_holds_the_knobs_that_mattered() -> None:
    from lorafleet.research.config import config_point, load_config

    loaded = load_config(HEADINGS)  # validates every choice against GenerationTrainConfig
    space = loaded.research.space
    assert {"learning_rate", "lr_scheduler", "lora.r"} <= set(space)
    # The study's first trial is the shipped recipe itself, every searched value of it inside the space.
    point, outside = config_point(space, load_generation_config(HEADINGS))
    assert loaded.research.start_from_config and outside == [] and set(point) == set(space)
    # Every rank research can pick loads on the engine of configs/fleet-generative.yaml, so any winner promotes.
    fleet = yaml.safe_load((REPO / "configs" / "fleet-generative.yaml").read_text())
    max_rank = next(b["options"]["max_lora_rank"] for b in fleet["bases"] if b.get("runtime") == "vllm")
    assert max(space["lora.r"].choices) <= max_rank  # type: ignore[union-attr]


def test_every_ablation_arm_is_a_valid_config() -> None:
    from lorafleet.bench.train_generation import RECIPE_ARMS, recipe_config

    for arm, spec in RECIPE_ARMS.items():
        cfg = recipe_config(spec, train=16, evals=4)
        assert cfg.data.max_train_examples == 16 and cfg.device == "cpu", arm
        for key, value in spec.items():
            if key == "full":
                continue
            node: Any = cfg
            for part in key.split("."):
                node = getattr(node, part)
            assert node == value, (arm, key)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    from lorafleet.testing import build_tiny_llama
    from lorafleet.train.statutes import parse_law

    corpus = [s.title + ". " + s.text for law in ("kschg", "agg") for s in parse_law(data_dir, law).sections]
    return build_tiny_llama(tmp_path_factory.mktemp("llama") / "m", corpus=corpus, vocab_size=800)


def test_schedule_reaches_the_trainer_and_the_loss_is_on_the_heading_only(tiny_llama: Path, data_dir: Path,
                                                                          tmp_path: Path) -> None:
    from lorafleet.train.kinds.generation.causal_lm import load_causal_base

    cfg = GenerationTrainConfig.model_validate({
        "base_model": str(tiny_llama), "device": "cpu", "lr_scheduler": "cosine", "batch_size": 4,
        "data": {"laws": ["kschg", "agg"], "max_train_examples": 8, "max_eval_examples": 4, "input_max_tokens": 32},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}})
    model, tokenizer = load_causal_base(cfg.base_model, "cpu", "float32")
    dataset = build_headings(cfg.data, tokenizer, data_root=data_dir)
    trainer = build_sft_trainer(cfg, dataset, model, tokenizer, tmp_path)
    assert trainer.args.lr_scheduler_type == "cosine"
    for ex, row in zip(dataset.examples["train"], trainer.train_dataset, strict=True):
        # The scored tokens are exactly the assistant turn as the template renders it after the prompt.
        conv = ex.messages(dataset.system_prompt)
        prompt = tokenizer.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        full = tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
        assert row["input_ids"] == full
        assert row["labels"] == [-100] * len(prompt) + full[len(prompt):]  # trl folds the completion mask in
        assert ex.heading in tokenizer.decode(full[len(prompt):])


def test_recipe_defaults_are_documented() -> None:
    # The config file's comments name the recipe; a drifted comment is caught by the values above, the file's
    # own keys here.
    raw = yaml.safe_load(HEADINGS.read_text())["train"]
    assert {"learning_rate", "epochs", "lr_scheduler"} <= set(raw)
