"""promote / rollback against a real MLflow store and a real nats-server KV bucket; bad input changes nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lorafleet.core.config import BaseModelSpec, FleetConfig
from lorafleet.core.fleet_state import FleetEntry, FleetStateError, ensure_fleet_bucket, read_entries
from lorafleet.registry import promote as prom
from lorafleet.registry import store

pytestmark = pytest.mark.integration


def _register(adapter: Path, base_source: Path, score: float, base: str = "tiny") -> str:
    return store.register_bundle("legal", adapter, base_source=str(base_source), base_name=base,
                                 metrics={"test_ndcg@10": score, "base_test_ndcg@10": 0.30}).version


async def _kv(url: str, create: bool) -> dict[str, FleetEntry]:
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        if create:
            await ensure_fleet_bucket(js)
            return {}
        return await read_entries(await js.key_value("lorafleet_fleet"))
    finally:
        await nc.close()


@pytest.fixture
def fleet_file(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(FleetConfig(bases=[BaseModelSpec(name="tiny", source="x")]).model_dump_json())
    return path


def test_promote_gate_rollback(nats_server, fleet_file: Path, tiny_adapter: Path, tiny_model_dir: Path) -> None:
    url = nats_server.url
    _register(tiny_adapter, tiny_model_dir, 0.40)
    _register(tiny_adapter, tiny_model_dir, 0.45)
    _register(tiny_adapter, tiny_model_dir, 0.43)

    # No bucket yet (no gateway/worker ever started): refused, alias untouched.
    with pytest.raises(FleetStateError, match="KV bucket 'lorafleet_fleet' does not exist"):
        prom.promote("legal", "1", nats_url=url, fleet_file=fleet_file)
    assert store.alias_version("legal", "champion") is None
    asyncio.run(_kv(url, create=True))

    out = prom.promote("legal", "1", nats_url=url, fleet_file=fleet_file)
    assert out.version == "1" and out.gate is not None and out.gate.ok
    out = prom.promote("legal", "2", nats_url=url, fleet_file=fleet_file)
    assert store.alias_version("legal", "champion") == "2"
    entry = asyncio.run(_kv(url, create=False))["legal"]
    assert (entry.adapter_id, entry.adapter_uri, entry.base, entry.version) == \
        ("legal@v2", "models:/legal/2", "tiny", "2")

    # v3 is below the champion v2: refused with the gap, nothing moved.
    with pytest.raises(prom.PromotionError, match=r"0\.0200 below the champion v2's 0\.4500"):
        prom.promote("legal", "3", nats_url=url, fleet_file=fleet_file)
    assert store.alias_version("legal", "champion") == "2"
    assert asyncio.run(_kv(url, create=False))["legal"].version == "2"
    # A relative margin the version cannot reach over the base (0.30 × 1.6 = 0.48 > 0.45).
    with pytest.raises(prom.PromotionError, match=r"below what it needs: the base model's 0\.3000 and a relative "
                                                  r"margin of 60\.0% \(0\.4800\)"):
        prom.promote("legal", "2", margin=0.6, nats_url=url, fleet_file=fleet_file)
    # --force skips the gate.
    out = prom.promote("legal", "3", force=True, nats_url=url, fleet_file=fleet_file)
    assert out.previous == "2" and store.alias_version("legal", "champion") == "3"

    out = prom.rollback("legal", nats_url=url, fleet_file=fleet_file)
    assert (out.version, out.previous) == ("2", "3")
    assert asyncio.run(_kv(url, create=False))["legal"].adapter_id == "legal@v2"
    assert prom.rollback("legal", nats_url=url, fleet_file=fleet_file).version == "1"
    with pytest.raises(prom.PromotionError, match="no previous champion"):
        prom.rollback("legal", nats_url=url, fleet_file=fleet_file)
    assert store.alias_version("legal", "champion") == "1"


def test_bad_input_changes_nothing(nats_server, fleet_file: Path, tiny_adapter: Path, tiny_model_dir: Path,
                                   tmp_path: Path) -> None:
    url = nats_server.url
    asyncio.run(_kv(url, create=True))
    with pytest.raises(store.RegistryError, match="no registered model named 'legal'"):
        prom.promote("legal", nats_url=url, fleet_file=fleet_file)
    _register(tiny_adapter, tiny_model_dir, 0.40, base="other-base")
    with pytest.raises(store.RegistryError, match="has no version 9"):
        prom.promote("legal", "9", nats_url=url, fleet_file=fleet_file)
    with pytest.raises(prom.PromotionError, match="runs on base 'other-base', which this fleet does not serve"):
        prom.promote("legal", "1", nats_url=url, fleet_file=fleet_file)
    with pytest.raises(FleetStateError, match=r"cannot reach nats-server at nats://127\.0\.0\.1:9"):
        prom.promote("legal", "1", nats_url="nats://127.0.0.1:9", fleet_file=fleet_file)
    with pytest.raises(prom.PromotionError, match="no local cluster is recorded"):
        prom.promote("legal", "1")
    assert store.alias_version("legal", "champion") is None
    assert asyncio.run(_kv(url, create=False)) == {}
