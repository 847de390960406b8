"""Bundle folder format: build, verify, and refuse tampered or incomplete bundles (pure file logic)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lorafleet.core.config import ServingProfile
from lorafleet.registry.bundle import (
    BundleError,
    BundleIntegrityError,
    base_name_for,
    build_bundle,
    read_spec,
    sha256_file,
    verify_bundle,
)


def _build(tmp_path: Path, tiny_adapter: Path, tiny_model_dir: Path) -> Path:
    report = tmp_path / "report.md"
    report.write_text("# eval\nnDCG@10 0.5\n")
    out = tmp_path / "bundle"
    build_bundle(out, name="german-legal", adapter_dir=tiny_adapter, base_source=str(tiny_model_dir),
                 base_name="tiny", profile=ServingProfile(max_batch_items=8), profile_source="tuned",
                 metrics={"test_ndcg@10": 0.5, "base_test_ndcg@10": 0.4, "note": "x"},  # type: ignore[dict-item]
                 dataset_digest="abc123", report_paths=[report])
    return out


def test_build_records_everything(tmp_path: Path, tiny_adapter: Path, tiny_model_dir: Path) -> None:
    out = _build(tmp_path, tiny_adapter, tiny_model_dir)
    spec = verify_bundle(out)
    assert spec.base.name == "tiny" and spec.base.source == str(tiny_model_dir)
    assert spec.pooling == "mean" and spec.normalize is True and spec.max_seq_length == 64
    assert spec.profile.max_batch_items == 8 and spec.profile_source == "tuned"
    assert spec.metrics == {"test_ndcg@10": 0.5, "base_test_ndcg@10": 0.4}  # non-numbers dropped
    assert spec.dataset_digest == "abc123"
    assert set(spec.files) == {"adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                               "report/report.md", "dataset_digest.txt"}
    assert spec.files["adapter/adapter_config.json"] == sha256_file(out / "adapter" / "adapter_config.json")
    assert read_spec(out) == spec


@pytest.mark.parametrize("damage", ["flip_byte", "delete", "extra", "spec_edit"])
def test_tampered_bundle_is_refused(tmp_path: Path, tiny_adapter: Path, tiny_model_dir: Path, damage: str) -> None:
    out = _build(tmp_path, tiny_adapter, tiny_model_dir)
    spec_sha = sha256_file(out / "bundle.yaml")
    weights = out / "adapter" / "adapter_model.safetensors"
    if damage == "flip_byte":
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
        match = "sha256 mismatch in adapter/adapter_model.safetensors"
    elif damage == "delete":
        weights.unlink()
        match = "missing adapter/adapter_model.safetensors"
    elif damage == "extra":
        (out / "adapter" / "evil.py").write_text("print('hi')")
        match = "unexpected file adapter/evil.py"
    else:
        raw = yaml.safe_load((out / "bundle.yaml").read_text())
        raw["metrics"]["test_ndcg@10"] = 0.99
        (out / "bundle.yaml").write_text(yaml.safe_dump(raw))
        match = "changed after registration"
    with pytest.raises(BundleIntegrityError, match=match):
        verify_bundle(out, spec_sha)


def test_missing_spec_and_bad_adapter(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(BundleIntegrityError, match=r"no bundle\.yaml"):
        verify_bundle(tmp_path / "empty")
    (tmp_path / "notpeft").mkdir()
    with pytest.raises(BundleError, match="not a peft adapter"):
        build_bundle(tmp_path / "b", name="x", adapter_dir=tmp_path / "notpeft", base_source=str(tiny_model_dir))


def test_base_name_for_packaged_and_paths(minilm_path: Path) -> None:
    assert base_name_for("all-MiniLM-L6-v2") == "all-MiniLM-L6-v2"
    assert base_name_for(str(minilm_path)) == "all-MiniLM-L6-v2"
    assert base_name_for("intfloat/multilingual-e5-small") == "multilingual-e5-small"
