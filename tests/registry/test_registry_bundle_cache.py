"""The bundle cache (LORAFLEET_HOME/bundles) stays under LORAFLEET_BUNDLE_CACHE_BYTES: least recently used bundles
go after a download, never the one just fetched. Real MLflow store and downloads; the prune rules on real folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lorafleet.core.config import ServingProfile
from lorafleet.registry import bundle_cache, store
from lorafleet.registry.uri import resolve_models_uri


def _bundle(root: Path, name: str, version: int, nbytes: int, mtime: float) -> Path:
    folder = root / name / f"v{version}"
    (folder / "adapter").mkdir(parents=True)
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"\0" * nbytes)
    os.utime(folder, (mtime, mtime))
    return folder


def test_prune_deletes_least_recently_used_never_the_one_kept(tmp_path: Path) -> None:
    root = tmp_path / "bundles"
    old = _bundle(root, "legal", 1, 1000, 100.0)
    mid = _bundle(root, "legal", 2, 1000, 200.0)
    other = _bundle(root, "tax", 1, 1000, 300.0)
    (root / ".legal-v3.partial-x").mkdir()  # a download in progress is not a bundle
    assert bundle_cache.cached_bundles(root) == [old, mid, other]
    assert bundle_cache.prune(root, 3000, keep=other) == []  # fits: nothing goes
    assert bundle_cache.prune(root, 2500, keep=other) == [old]
    assert bundle_cache.prune(root, 0, keep=mid) == [other]  # the kept one stays even alone over the bound
    assert bundle_cache.cached_bundles(root) == [mid] and not (root / "tax").exists()
    assert (root / ".legal-v3.partial-x").is_dir() and not list(root.glob(".*deleting*"))


def test_cache_limit_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(bundle_cache.ENV_CACHE_BYTES, raising=False)
    assert bundle_cache.cache_limit() == 10 * 1024**3
    monkeypatch.setenv(bundle_cache.ENV_CACHE_BYTES, "5_000")
    assert bundle_cache.cache_limit() == 5000
    for bad in ("10GiB", "-1"):
        monkeypatch.setenv(bundle_cache.ENV_CACHE_BYTES, bad)
        with pytest.raises(ValueError, match=r"LORAFLEET_BUNDLE_CACHE_BYTES=.*whole number of bytes"):
            bundle_cache.cache_limit()


@pytest.mark.integration  # real MLflow store
def test_downloads_keep_the_cache_bounded(tiny_adapter: Path, tiny_model_dir: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for score in (0.4, 0.5, 0.6):
        store.register_bundle("legal", tiny_adapter, base_source=str(tiny_model_dir), base_name="tiny",
                              profile=ServingProfile(), metrics={"test_ndcg@10": score}, dataset_digest="d1")
    v1 = resolve_models_uri("models:/legal/1").parent
    one = bundle_cache.folder_bytes(v1)
    monkeypatch.setenv(bundle_cache.ENV_CACHE_BYTES, str(int(one * 2.5)))  # room for two bundles
    v2 = resolve_models_uri("models:/legal/2").parent
    assert resolve_models_uri("models:/legal/1").parent == v1  # reused, and now more recent than v2
    v3 = resolve_models_uri("models:/legal/3").parent
    assert bundle_cache.cached_bundles(bundle_cache.cache_root()) == [v1, v3] and not v2.exists()
    assert resolve_models_uri("models:/legal/2").parent == v2  # downloaded again when asked for
    assert bundle_cache.cached_bundles(bundle_cache.cache_root()) == [v3, v2]
    monkeypatch.setenv(bundle_cache.ENV_CACHE_BYTES, "1")
    assert (resolve_models_uri("models:/legal/1") / "adapter_config.json").is_file()  # never the one just fetched
    assert bundle_cache.cached_bundles(bundle_cache.cache_root()) == [v1]
