"""Fixtures for the research tests: a research YAML around the tiny random BERT and a small law."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from research_testkit import tiny_config


@pytest.fixture
def research_yaml(tmp_path: Path, tiny_model_dir: Path) -> Callable[..., Path]:
    def write(study: str = "tiny", **research: Any) -> Path:
        path = tmp_path / f"{study}.yaml"
        path.write_text(yaml.safe_dump(tiny_config(tiny_model_dir, study, **research), sort_keys=False))
        return path

    return write
