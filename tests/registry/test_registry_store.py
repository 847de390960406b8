"""Bundles in a real MLflow store (sqlite under the test's LORAFLEET_HOME): register, alias, list, download."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.core.config import ServingProfile
from lorafleet.core.refs import parse_models_uri
from lorafleet.registry import store
from lorafleet.registry.bundle import BundleIntegrityError, read_spec
from lorafleet.registry.uri import resolve_models_uri

pytestmark = pytest.mark.integration  # real MLflow store


def _register(tiny_adapter: Path, tiny_model_dir: Path, score: float, alias: str | None = None) -> store.BundleRef:
    return store.register_bundle(
        "legal", tiny_adapter, base_source=str(tiny_model_dir), base_name="tiny",
        profile=ServingProfile(max_batch_items=16), profile_source="tuned",
        metrics={"test_ndcg@10": score, "base_test_ndcg@10": 0.30}, dataset_digest="d1", alias=alias,
    )


def test_register_alias_list_download(tmp_path: Path, tiny_adapter: Path, tiny_model_dir: Path) -> None:
    ref1 = _register(tiny_adapter, tiny_model_dir, 0.41, alias="candidate")
    ref2 = _register(tiny_adapter, tiny_model_dir, 0.45, alias="candidate")
    assert ref1 == ("legal", "1") and ref2 == ("legal", "2")

    infos = store.versions("legal")
    assert [i.version for i in infos] == ["1", "2"]
    assert infos[1].aliases == ["candidate"] and infos[0].aliases == []
    assert infos[1].metric("test_ndcg@10") == pytest.approx(0.45)
    assert infos[1].tags["test_ndcg_at_10"] == "0.45" and infos[1].tags["base_model"] == "tiny"
    assert infos[1].tags["test_ndcg_gain"] == "0.15"
    # A short, readable set of tags and the result in one sentence; the rest lives in the bundle.
    assert set(infos[1].tags) == {"test_ndcg_at_10", "base_test_ndcg_at_10", "test_ndcg_gain", "base_model",
                                  "dataset_digest", "profile_source", "bundle_sha256", "lorafleet.task"}
    assert store.client().get_model_version("legal", "2").description == (
        "test nDCG@10 0.450 vs base 0.300 (+50 %); LoRA on tiny, trained on dataset d1.")
    assert store.get_version("legal", "candidate").version == "2"
    assert store.get_version("legal", "v1").version == "1"
    assert [n for n, _ in store.list_models()] == ["legal"]

    store.set_alias("legal", "champion", 1)
    assert store.alias_version("legal", "champion") == "1"

    path = store.download_bundle("legal", "candidate", tmp_path / "dl")
    spec = read_spec(path)
    assert spec.profile.max_batch_items == 16 and spec.metrics["test_ndcg@10"] == 0.45
    assert (path / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (tiny_adapter / "adapter_model.safetensors").read_bytes()
    # Reuse: a second download into the same folder checks it again and returns it.
    assert store.download_bundle("legal", "2", tmp_path / "dl") == path

    # The worker-side resolver: models:/ URIs land in LORAFLEET_HOME/bundles and are cached.
    assert parse_models_uri("models:/legal/v2")[:2] == ("legal", "2")
    assert parse_models_uri("models:/legal@champion").ref == "champion"
    adapter = resolve_models_uri("models:/legal/1")
    assert adapter == store.bundle_cache_dir("legal", "1") / "adapter"
    assert (adapter / "adapter_config.json").is_file()


def test_tampered_store_copy_is_refused(tmp_path: Path, tiny_adapter: Path, tiny_model_dir: Path) -> None:
    ref = _register(tiny_adapter, tiny_model_dir, 0.4)
    info = store.get_version(*ref)
    stored = Path(info.source.removeprefix("file://")) / "adapter" / "adapter_model.safetensors"
    data = bytearray(stored.read_bytes())
    data[100] ^= 0x01
    stored.write_bytes(bytes(data))
    with pytest.raises(BundleIntegrityError, match=r"sha256 mismatch in adapter/adapter_model\.safetensors"):
        store.download_bundle(*ref, tmp_path / "dl")
    assert not (tmp_path / "dl").exists(), "a refused bundle must leave nothing behind"
    stored.unlink()
    with pytest.raises(BundleIntegrityError, match=r"missing adapter/adapter_model\.safetensors"):
        store.download_bundle(*ref, tmp_path / "dl")
    from lorafleet.core.adapters import AdapterUnavailable

    with pytest.raises(AdapterUnavailable, match="missing"):
        resolve_models_uri(f"models:/{ref.name}/{ref.version}")


def test_unknown_names_versions_aliases(tiny_adapter: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(store.RegistryError, match="no registered model named 'nope'"):
        store.versions("nope")
    _register(tiny_adapter, tiny_model_dir, 0.4)
    with pytest.raises(store.RegistryError, match=r"has no version 7 \(versions: 1\)"):
        store.get_version("legal", "7")
    with pytest.raises(store.RegistryError, match="has no alias 'champion'"):
        store.get_version("legal", "champion")
    with pytest.raises(store.RegistryError, match="must match"):
        store.register_bundle("bad name", tiny_adapter, base_source=str(tiny_model_dir))


def test_unreachable_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with pytest.raises(store.StoreUnreachable, match=r"cannot reach the MLflow store at http://127\.0\.0\.1:9"):
        store.list_models()
