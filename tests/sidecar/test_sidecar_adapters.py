"""Adapter URIs and the LRU adapter cache (with a recording fake runtime)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lorafleet.adapters import AdapterUnavailable, register_adapter_scheme, resolve_adapter_uri
from lorafleet.sidecar.adapters import AdapterCache, LruSet
from lorafleet.sidecar.runtime import Runtime


class RecordingRuntime(Runtime):
    capabilities = frozenset({"embed"})

    @property
    def dim(self) -> int:
        return 2

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self._loaded: list[str] = []

    def encode(self, texts: list[str], adapter_id: str | None) -> np.ndarray:
        return np.zeros((len(texts), 2), dtype=np.float32)

    def load_adapter(self, adapter_id: str, path: str) -> None:
        self.events.append(("load", adapter_id))
        self._loaded.append(adapter_id)

    def unload_adapter(self, adapter_id: str) -> None:
        self.events.append(("unload", adapter_id))
        self._loaded.remove(adapter_id)

    def loaded_adapters(self) -> list[str]:
        return list(self._loaded)

    def close(self) -> None:
        pass


def test_runtime_plugins_are_found_by_name_and_checked() -> None:
    from lorafleet.plugins import PluginError
    from lorafleet.sidecar.runtime import runtime_class
    from lorafleet.sidecar.st_runtime import SentenceTransformerRuntime

    assert runtime_class("sentence-transformers") is SentenceTransformerRuntime
    with pytest.raises(PluginError, match=r"unknown runtime 'nope'; known: sentence-transformers, synthetic"):
        runtime_class("nope")


def test_lru_set_evicts_least_recently_used() -> None:
    lru = LruSet(2)
    assert lru.touch("a") == [] and lru.touch("b") == []
    assert lru.touch("a") == []  # a is now most recent
    assert lru.touch("c") == ["b"]
    assert lru.keys() == ["a", "c"]
    with pytest.raises(ValueError):
        LruSet(0)


def test_cache_loads_once_and_evicts_lru_before_loading(tmp_path: Path) -> None:
    rt = RecordingRuntime()
    cache = AdapterCache(rt, 2, resolve=lambda uri: tmp_path / uri)
    assert cache.ensure("a", "a") is True
    assert cache.ensure("b", "b") is True
    assert cache.ensure("a", "a") is False  # already loaded; a becomes most recent
    assert cache.ensure("c", "c") is True
    assert rt.events == [("load", "a"), ("load", "b"), ("unload", "b"), ("load", "c")]
    assert cache.loaded() == ["a", "c"] and sorted(rt.loaded_adapters()) == ["a", "c"]


def test_cache_without_uri_is_unavailable() -> None:
    with pytest.raises(AdapterUnavailable, match="no URI"):
        AdapterCache(RecordingRuntime(), 2).ensure("x", None)


def adapter_dir(tmp_path: Path) -> Path:
    d = tmp_path / "ad"
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    return d


def test_resolve_plain_path_and_file_uri(tmp_path: Path) -> None:
    d = adapter_dir(tmp_path)
    assert resolve_adapter_uri(str(d)) == d.resolve()
    assert resolve_adapter_uri(d.as_uri()) == d.resolve()


def test_resolve_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(AdapterUnavailable, match="does not exist"):
        resolve_adapter_uri(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterUnavailable, match=r"adapter_config\.json"):
        resolve_adapter_uri(str(tmp_path / "empty"))
    with pytest.raises(AdapterUnavailable, match=r"known: \['file', 'models'\].*lorafleet\.adapter_sources"):
        resolve_adapter_uri("nosuchscheme:/name/3")


def test_registered_scheme_resolves(tmp_path: Path) -> None:
    d = adapter_dir(tmp_path)
    register_adapter_scheme("testreg", lambda uri: d if uri == "testreg:/x/1" else tmp_path / "nope")
    assert resolve_adapter_uri("testreg:/x/1") == d.resolve()


def test_adapter_policy_is_an_allow_list_that_reveals_nothing(tmp_path: Path) -> None:
    """Only registry schemes and folders under the roots; every refusal reads the same, whatever exists."""
    from lorafleet.adapters import AdapterPolicy

    root = tmp_path / "root"
    root.mkdir()
    inside = adapter_dir(root)  # root/ad
    (tmp_path / "other").mkdir()
    outside = adapter_dir(tmp_path / "other")
    (root / "out").symlink_to(outside)  # a link inside a root that leads out of it
    policy = AdapterPolicy([root], schemes=["policyreg"])
    register_adapter_scheme("policyreg", lambda uri: inside)
    assert policy.resolve(str(inside)) == inside.resolve()
    assert policy.resolve(inside.as_uri()) == inside.resolve()
    assert policy.resolve(str(root / "x" / ".." / "ad")) == inside.resolve()
    assert policy.resolve("policyreg:/x/1") == inside.resolve()  # verified sources come through their plugin

    refused = [str(outside), str(tmp_path / "missing"), "/etc", str(root / "out"), str(root / ".." / "other" / "ad"),
               outside.as_uri(), "models:/legal/1", "nosuchscheme:/x", "relative/../../../etc"]
    messages = set()
    for uri in refused:
        with pytest.raises(AdapterUnavailable) as exc:
            policy.resolve(uri)
        messages.add(str(exc.value).replace(repr(uri), "URI"))
    assert messages == {"adapter URI URI is not allowed on this worker: it loads adapters only from policyreg:… "
                        "references or folders under its adapter roots (worker.adapter_roots)"}
    with pytest.raises(AdapterUnavailable, match="no usable peft adapter") as missing:
        policy.resolve(str(root / "missing"))  # under a root: the operator's own folder, still no detail
    assert "does not exist" not in str(missing.value)
    long_uri = "/" + "x" * 100_000
    with pytest.raises(AdapterUnavailable) as exc:
        policy.resolve(long_uri)
    assert len(str(exc.value)) < 500
