"""Fixtures for the worker tests; the helpers live in sidecar_testkit (a unique module name)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sidecar_testkit import WorkerProcess, make_adapter


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(tiny_model_dir, root / name, seed) for seed, name in enumerate(["a", "b", "c"], 1)}


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Any]:
    """Factory: start_worker(fleet_dict, nats_url, worker_id) → a ready WorkerProcess; stopped afterwards."""
    started: list[WorkerProcess] = []

    def start(fleet: dict[str, Any], nats_url: str, worker_id: str = "w1") -> WorkerProcess:
        fleet_file = tmp_path / f"fleet-{worker_id}.yaml"
        fleet_file.write_text(yaml.safe_dump(fleet))
        w = WorkerProcess(fleet_file, nats_url, worker_id, tmp_path / f"{worker_id}.log")
        started.append(w)
        w.wait_ready()
        return w

    yield start
    for w in started:
        w.stop()
