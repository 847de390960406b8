"""What `lorafleet tune` accepts: adapter folder, bundle folder, registered NAME@alias / NAME/N, MLflow run id."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.core.config import ServingProfile
from lorafleet.pipeline import resolve_tune_source as resolve_source
from lorafleet.tune.config import TuneError

pytestmark = pytest.mark.integration  # real MLflow store


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorafleet.testing import make_random_adapter

    return make_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("a") / "lora", seed=2)


def test_adapter_and_bundle_folders(adapter: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    from lorafleet.registry.bundle import build_bundle

    src = resolve_source(str(adapter))
    assert src.adapter_dir == adapter and src.base_source == str(tiny_model_dir) and src.base_name == "tiny-bert"
    build_bundle(tmp_path / "b", name="legal", adapter_dir=adapter, base_source=str(tiny_model_dir),
                 profile=ServingProfile(max_batch_items=4))
    src = resolve_source(str(tmp_path / "b"))
    assert src.adapter_dir == tmp_path / "b" / "adapter" and src.profile.max_batch_items == 4  # type: ignore[union-attr]
    assert resolve_source(str(adapter), base="all-MiniLM-L6-v2").base_name == "all-MiniLM-L6-v2"


def test_registry_and_run_id(adapter: Path, tiny_model_dir: Path) -> None:
    from lorafleet.registry import store

    ref = store.register_bundle("legal", adapter, base_source=str(tiny_model_dir), alias="candidate")
    src = resolve_source("legal@candidate")
    assert (src.adapter_dir / "adapter_config.json").is_file() and src.label == "legal-v1"
    assert resolve_source("legal/1").adapter_dir == src.adapter_dir
    run_id = store.get_version(*ref).run_id
    assert run_id is not None
    src = resolve_source(run_id)  # the run logged the bundle, whose adapter/ is found among its artifacts
    assert (src.adapter_dir / "adapter_model.safetensors").is_file() and src.base_source == str(tiny_model_dir)
    with pytest.raises(TuneError, match="does not exist"):
        resolve_source("0" * 32)
    with pytest.raises(TuneError, match="is not an adapter folder"):
        resolve_source("what ever")
