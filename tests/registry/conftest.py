"""Fixtures for registry tests: a tiny random LoRA adapter on the tiny BERT (fast, offline)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorafleet.testing import make_random_adapter

    return make_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter") / "a", seed=3)
