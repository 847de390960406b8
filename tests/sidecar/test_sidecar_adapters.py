"""Adapter URIs and the adapter cache's memory tiers (fake runtimes for the logic, the tiny BERT for the real one)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorafleet.core.adapters import AdapterUnavailable, register_adapter_scheme, resolve_adapter_uri
from lorafleet.sidecar import metrics as m
from lorafleet.sidecar.adapters import AdapterCache, LruSet, files_nbytes
from lorafleet.sidecar.metrics import WorkerMetrics
from lorafleet.sidecar.runtime import AdapterWeights, Runtime


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
    from lorafleet.core.plugins import PluginError
    from lorafleet.sidecar.runtime import runtime_class
    from lorafleet.sidecar.st_runtime import SentenceTransformerRuntime

    assert runtime_class("sentence-transformers") is SentenceTransformerRuntime
    with pytest.raises(PluginError, match=r"unknown runtime 'nope'; known: .*sentence-transformers, .*synthetic"):
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
    from lorafleet.core.adapters import AdapterPolicy

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


# -- memory tiers (device → host → disk → registry) ------------------------------------------------------------


class TieredRuntime(Runtime):
    """A fake runtime with a host tier: `read_adapter` returns weights of `sizes[id]` bytes. Adapters named
    bad* fit no base (AdapterUnavailable), flaky* fail with an I/O error. It asserts that no pinned adapter is
    unloaded and that every load fits the device (it reads the cache it serves)."""

    capabilities = frozenset({"embed"})
    dim = 2

    def __init__(self, sizes: dict[str, int], host: bool = True) -> None:
        self.sizes, self.host = sizes, host
        self.cache: AdapterCache | None = None
        self.calls: list[tuple[str, str]] = []
        self._loaded: list[str] = []

    def read_adapter(self, adapter_id: str, path: str) -> AdapterWeights | None:
        self.calls.append(("read", adapter_id))
        return AdapterWeights(path, self.sizes[adapter_id]) if self.host else None

    def load_adapter_weights(self, adapter_id: str, weights: AdapterWeights) -> None:
        self.calls.append(("load_weights", adapter_id))
        self._load(adapter_id)

    def load_adapter(self, adapter_id: str, path: str) -> None:
        self.calls.append(("load", adapter_id))
        self._load(adapter_id)

    def _load(self, adapter_id: str) -> None:
        if adapter_id.startswith("bad"):
            raise AdapterUnavailable(f"{adapter_id} does not fit")
        if adapter_id.startswith("flaky"):
            raise OSError("disk hiccup")
        assert adapter_id not in self._loaded
        self._loaded.append(adapter_id)

    def unload_adapter(self, adapter_id: str) -> None:
        assert self.cache is not None and adapter_id not in self.cache._pins, f"unloaded pinned {adapter_id}"
        self.calls.append(("unload", adapter_id))
        self._loaded.remove(adapter_id)

    def loaded_adapters(self) -> list[str]:
        return list(self._loaded)


def tiered(tmp_path: Path, sizes: dict[str, int], host: bool = True, **kw: Any) -> tuple[AdapterCache, TieredRuntime,
                                                                                        list[str]]:
    rt = TieredRuntime(sizes, host)
    resolved: list[str] = []

    def resolve(uri: str) -> Path:
        resolved.append(uri)
        return tmp_path / uri

    rt.cache = AdapterCache(rt, resolve=resolve, **kw)
    return rt.cache, rt, resolved


def test_tiers_stay_within_their_bounds_under_churn(tmp_path: Path) -> None:
    rng = random.Random(16)
    sizes = {f"ad{i}": rng.randint(1, 4) * 1024 for i in range(60)}
    metrics = WorkerMetrics(["m"])
    cache, rt, _ = tiered(tmp_path, sizes, max_adapters=5, device_bytes=10 * 1024, host_bytes=16 * 1024,
                          events=metrics.adapter_events("m"))
    counts = {"ready": 0, "deferred": 0, "host": 0}
    for _ in range(1500):
        wanted = {a: a for a in rng.sample(sorted(sizes), rng.randint(1, 4))}
        with cache.use(wanted) as use:
            assert use.ready and use.ready | use.deferred == set(wanted) and not use.failed  # progress
            assert use.ready <= set(rt.loaded_adapters())  # usable while the with-block lasts
            assert all(cache.tier_of(a) == "device" for a in use.ready)
            counts["ready"] += len(use.ready)
            counts["deferred"] += len(use.deferred)
            counts["host"] += sum(s == "host" for s in use.sources.values())
        stats = cache.stats()
        assert stats["device"].nbytes == sum(sizes[a] for a in cache.loaded()) <= 10 * 1024
        assert stats["device"].adapters == len(cache.loaded()) <= 5
        assert stats["host"].nbytes <= 16 * 1024
        assert sorted(cache.loaded()) == sorted(rt.loaded_adapters())
        assert not cache._pins
    assert counts["deferred"] > 0 and counts["host"] > 0  # the churn really hit both limits and the warm tier
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(metrics.render().decode()) for s in fam.samples}
    for tier in ("device", "host"):
        assert samples[(m.ADAPTER_TIER_BYTES, (("base", "m"), ("tier", tier)))] == cache.stats()[tier].nbytes
    loads = sum(samples[(f"{m.ADAPTER_LOADS_BY_SOURCE}_total", (("base", "m"), ("source", s)))]
                for s in ("host", "disk", "registry"))
    assert loads == samples[(f"{m.ADAPTER_LOADS}_total", (("base", "m"),))] == sum(c[0] != "unload" and
                                                                                   c[0] != "read" for c in rt.calls)
    assert samples[(f"{m.ADAPTER_TIER_EVICTIONS}_total", (("base", "m"), ("tier", "host")))] > 0


def test_pinned_adapters_are_never_evicted_and_others_wait(tmp_path: Path) -> None:
    cache, rt, resolved = tiered(tmp_path, {"a": 10, "b": 10, "c": 10, "d": 10}, max_adapters=2)
    with cache.use({"a": "a", "b": "b", "c": "c"}) as use:
        assert use.ready == {"a", "b"} and use.deferred == {"c"} and use.loaded_now == {"a", "b"}
        assert cache.tier_of("c") == "host"  # read while looking for room: the next pass skips the disk
        with pytest.raises(RuntimeError, match="pinned"):
            cache.ensure("c", "c")
        assert cache.preload("c", "c") == "host"  # no room on the device: it stays warm
        assert cache.preload("d", "d") == "disk" and cache.tier_of("d") == "host"  # read from disk, kept warm
    assert ("unload", "a") not in rt.calls and ("unload", "b") not in rt.calls
    with cache.use({"c": "c"}) as use:  # the next pass: a (least recently used) makes room
        assert use.ready == {"c"} and use.sources == {"c": "host"}
    assert rt.calls[-2:] == [("unload", "a"), ("load_weights", "c")] and resolved == ["a", "b", "c", "d"]
    assert cache.tier_of("a") == "host" and cache.loaded() == ["b", "c"]


def test_a_failed_load_fails_only_its_own_adapter(tmp_path: Path) -> None:
    cache, rt, _ = tiered(tmp_path, {"good": 1, "bad": 1, "flaky": 1})
    with cache.use({"bad": "bad", "flaky": "flaky", "good": "good", "nouri": None}) as use:
        assert use.ready == {"good"} and not use.deferred
        assert isinstance(use.failed["bad"], AdapterUnavailable)
        assert isinstance(use.failed["flaky"], OSError)  # transient: the caller retries its tasks
        assert isinstance(use.failed["nouri"], AdapterUnavailable) and "no URI" in str(use.failed["nouri"])
    assert cache.loaded() == ["good"] == rt.loaded_adapters()
    assert cache.stats()["device"].nbytes == 1


def test_a_warm_adapter_loads_from_host_memory(tmp_path: Path) -> None:
    cache, rt, resolved = tiered(tmp_path, {"a": 100, "b": 100}, max_adapters=1, host_bytes=100)
    assert cache.preload("a", "a") == "disk"
    assert cache.preload("b", "models:/b/1") == "registry"  # b evicts a to host memory
    assert cache.tier_of("a") == "host" and cache.stats()["host"].nbytes == 100
    assert cache.ensure("a", "a") is True  # a back from host, b down to host
    assert resolved == ["a", "models:/b/1"] and rt.calls.count(("load_weights", "a")) == 2  # read once, loaded twice
    assert cache.tier_of("b") == "host" and cache.preload("a", "a") == "device"
    cache.host_bytes = 0
    assert cache.preload("b", "b") == "host"  # nothing fits host memory now: a is dropped, not moved down
    assert cache.tier_of("a") is None and cache.stats()["host"].nbytes == 0


def test_an_adapter_larger_than_the_device_tier_says_which_setting_to_raise(tmp_path: Path) -> None:
    cache, rt, _ = tiered(tmp_path, {"big": 3 * 1024 * 1024, "small": 10}, device_bytes=1024 * 1024)
    with cache.use({"big": "big", "small": "small"}) as use:
        assert use.ready == {"small"}
        assert isinstance(use.failed["big"], AdapterUnavailable)
        assert "raise worker.profile.adapter_device_bytes" in str(use.failed["big"])
    assert ("load_weights", "big") not in rt.calls


def test_without_a_host_tier_bytes_are_the_weight_files(tmp_path: Path) -> None:
    for name, size in (("a", 600), ("b", 500)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_model.safetensors").write_bytes(b"\0" * size)
        (tmp_path / name / "adapter_config.json").write_text("{}")
    cache, _, _ = tiered(tmp_path, {}, host=False, device_bytes=1000)
    assert cache.ensure("a", "a") and cache.stats()["device"].nbytes == 600
    assert cache.ensure("b", "b")  # 1100 > 1000: a leaves, and is dropped (no host copy to keep)
    assert cache.loaded() == ["b"] and cache.tier_of("a") is None and cache.stats()["host"].adapters == 0


def test_tiers_on_the_real_runtime(tiny_model_dir: Path, tiny_adapters: dict[str, Path]) -> None:
    from lorafleet.core.config import BaseModelSpec
    from lorafleet.sidecar.st_runtime import SentenceTransformerRuntime

    rt = SentenceTransformerRuntime(BaseModelSpec(name="tiny", source=str(tiny_model_dir)), device="cpu")
    texts = ["ein Satz", "noch ein ganz anderer Satz"]
    cache = AdapterCache(rt, max_adapters=1)
    reference = {}
    for name in ("a", "b"):
        cache.ensure(name, str(tiny_adapters[name]))
        reference[name] = rt.encode(texts, name)
    nbytes = cache.stats()["device"].nbytes
    assert 0 < nbytes < files_nbytes(tiny_adapters["b"])  # the tensors, without the file's header
    assert cache.tier_of("a") == "host" and cache.stats()["host"].nbytes > 0
    with cache.use({"a": str(tiny_adapters["a"])}) as use:
        assert use.sources == {"a": "host"} and rt.loaded_adapters() == ["a"]
        got = rt.encode(texts, "a")
    cos = (got * reference["a"]).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference["a"], axis=1)
    assert cos.min() > 0.9999 and not np.allclose(reference["a"], reference["b"])
    rt.close()


def test_the_profile_sizes_the_tiers_and_refuses_nonsense() -> None:
    from pydantic import ValidationError

    from lorafleet.core.config import MIB, ServingProfile, WorkerConfig

    p = ServingProfile()
    assert (p.mixed_adapter_batches, p.max_batch_adapters) == (True, 64)
    assert (p.adapter_device_bytes, p.adapter_host_bytes, WorkerConfig().max_adapters) == (256 * MIB, 512 * MIB, 1024)
    assert ServingProfile(adapter_host_bytes=0, adapter_device_bytes=MIB).adapter_host_bytes == 0
    for bad in ({"adapter_device_bytes": MIB - 1}, {"adapter_host_bytes": -1}, {"max_batch_adapters": 0},
                {"max_batch_adapters": 4097}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            ServingProfile(**bad)
