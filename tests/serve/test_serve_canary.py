"""The canary's sticky split (issue 25): the hash that puts a route key on one side, the resolver that routes the
plain name by it, the route key taken from a request. Pure logic: the cluster-level test is
tests/integration/test_canary.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lorafleet.core.fleet_state import FleetEntry, by_adapter_id, canary_spec, route_bucket, takes_canary
from lorafleet.serve.metrics import GatewayMetrics
from lorafleet.serve.resolver import Resolver, route_key

BASE, NAME = "tiny", "legal"


def _entry(version: str) -> FleetEntry:
    return FleetEntry(name=NAME, base=BASE, adapter_id=f"{NAME}@v{version}", adapter_uri=f"models:/{NAME}/{version}",
                      version=version, registered_model=NAME)


def _with_canary(percent: float) -> FleetEntry:
    return _entry("1").model_copy(update={"canary": canary_spec(_entry("2"), percent)})


@pytest.mark.parametrize("percent", [1.0, 10.0, 20.0, 50.0, 90.0])
def test_split_share_over_10k_keys_within_2_points(percent: float) -> None:
    keys = [f"client-{i}" for i in range(10_000)]
    share = 100.0 * sum(route_bucket(NAME, k) < percent for k in keys) / len(keys)
    assert abs(share - percent) <= 2.0, share


def test_split_is_sticky_and_monotonic() -> None:
    keys = [f"k{i}" for i in range(2000)]
    first = [route_bucket(NAME, k) for k in keys]
    assert first == [route_bucket(NAME, k) for k in keys]  # the same answer every time
    assert all(0.0 <= b < 100.0 for b in first)
    at10 = {k for k in keys if takes_canary(_with_canary(10), k)}
    at20 = {k for k in keys if takes_canary(_with_canary(20), k)}
    assert at10 < at20  # raising the share only adds keys: none switches back
    assert not takes_canary(_with_canary(20), None)  # no key: the champion
    assert not takes_canary(_entry("1"), "k1")  # no canary


def test_split_is_the_same_in_another_process() -> None:
    """Never Python's hash() (salted per process): another interpreter with another hash seed agrees."""
    keys = ["a", "b", "client-7", "ümlaut"]
    code = ("import sys; from lorafleet.core.fleet_state import route_bucket; "
            f"print(repr([route_bucket({NAME!r}, k) for k in {keys!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout
    assert out.strip() == repr([route_bucket(NAME, k) for k in keys])


def test_resolver_routes_the_canary_share_and_serves_both_pinned() -> None:
    entry = _with_canary(20)
    r = Resolver([BASE])
    r.set_models([entry.served_model()], entries=[entry])
    assert r.has_splits and r.splits()[NAME].percent == 20
    seen = {f"k{i}": r.resolve(NAME, f"k{i}") for i in range(5000)}
    versions = {k: route.version for k, route in seen.items() if route is not None}
    share = sum(v == "2" for v in versions.values()) / len(versions)
    assert abs(share - 0.20) < 0.03, share
    for k, v in versions.items():  # every key on the side its bucket says
        assert v == ("2" if route_bucket(NAME, k) < 20 else "1")
        assert seen[k].name == NAME  # bounded labels: the plain name
    canary = next(route for route in seen.values() if route and route.version == "2")
    assert canary.adapter == "legal@v2" and canary.model == "legal@2"
    assert r.resolve(NAME).version == "1"  # no key: the champion
    assert r.resolve_pinned("legal@2").version == "2" and r.resolve_pinned("legal@1").version == "1"
    # The canary ends: everyone on the champion, the split gone.
    r.set_models([_entry("1").served_model()], entries=[_entry("1")])
    assert not r.has_splits and {r.resolve(NAME, k).version for k in seen} == {"1"}


def test_workers_know_the_canary_adapter() -> None:
    table = by_adapter_id([_with_canary(5)])
    assert table["legal@v2"].adapter == "models:/legal/2" and table["legal@v1"].name == NAME


def test_route_key_header_then_api_key_then_address() -> None:
    assert route_key("user-7", "Bearer sk-1", "10.0.0.1") == "h:user-7"
    by_key = route_key(None, "Bearer sk-1", "10.0.0.1")
    assert by_key.startswith("k:") and "sk-1" not in by_key and by_key == route_key(None, "Bearer sk-1", "10.0.0.2")
    assert route_key(None, "Bearer sk-2", "10.0.0.1") != by_key
    by_addr = route_key(None, None, "10.0.0.1")
    assert by_addr.startswith("a:") and "10.0.0.1" not in by_addr and by_addr != route_key(None, None, "10.0.0.2")


def test_metrics_per_version() -> None:
    m = GatewayMetrics(lambda: 0.0)
    m.request_done("embeddings", NAME, 200, 0.01, "2", tokens=7)
    m.request_done("embeddings", NAME, 500, 0.02, "2")
    m.request_done("embeddings", NAME, 200, 0.01, "1", tokens=3)
    m.request_done("embeddings", BASE, 200, 0.01)  # a base: no version series
    text = m.render().decode()
    assert 'lorafleet_gateway_version_requests_total{code="200",model="legal",version="2"} 1.0' in text
    assert 'lorafleet_gateway_version_requests_total{code="500",model="legal",version="2"} 1.0' in text
    assert 'lorafleet_gateway_version_tokens_total{model="legal",version="2"} 7.0' in text
    assert 'lorafleet_gateway_version_request_seconds_count{model="legal",version="1"} 1.0' in text
    assert f'version_requests_total{{code="200",model="{BASE}"' not in text
