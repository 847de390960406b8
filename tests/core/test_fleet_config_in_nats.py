"""The fleet file in the fleet KV bucket: what processes joining from another host read instead of a local file."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import nats
import pytest

from lorafleet.core.config import BaseModelSpec, FleetConfig, GatewayConfig, NatsClientConfig
from lorafleet.core.fleet_state import (
    FLEET_CONFIG_KEY,
    KEY_RE,
    FleetStateError,
    check_exec_consent,
    ensure_config_bucket,
    ensure_fleet_bucket,
    fetch_fleet_config,
    put_fleet_config,
    read_entries,
    shared_fleet_config,
)

FLEET = FleetConfig(
    nats_url="nats://10.0.0.5:4222",
    nats=NatsClientConfig(creds="/home/ops/admin.nk", tls_ca="/home/ops/ca.pem", replicas=3),
    bases=[BaseModelSpec(name="minilm", scale_to_zero=True)],
    gateway=GatewayConfig(api_keys=["sk-secret"], default_deadline_s=45),
)


def test_the_shared_copy_leaves_host_local_settings_and_secrets_out() -> None:
    data = json.loads(shared_fleet_config(FLEET))
    assert "nats_url" not in data
    assert "api_keys" not in data["gateway"] and data["gateway"]["default_deadline_s"] == 45
    assert data["nats"] == {"replicas": 3}
    assert "sk-secret" not in shared_fleet_config(FLEET).decode()
    assert data["bases"][0]["scale_to_zero"] is True
    FleetConfig.model_validate(data)  # it is a whole fleet file again
    assert not KEY_RE.match(FLEET_CONFIG_KEY), "the key can never be a served name"


async def test_a_published_fleet_file_round_trips_and_is_no_served_name(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        kv = await ensure_fleet_bucket(nc.jetstream())
        await put_fleet_config(await ensure_config_bucket(nc.jetstream()), FLEET)
        assert await read_entries(kv) == {}  # the watchers' table does not see it: it is in its own bucket
    finally:
        await nc.close()
    got = await asyncio.to_thread(fetch_fleet_config, nats_server.url, {})
    assert got.bases[0].name == "minilm" and got.gateway.api_keys == [] and got.nats.replicas == 3


async def test_no_fleet_file_in_nats_says_what_to_do(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        await ensure_fleet_bucket(nc.jetstream())
    finally:
        await nc.close()
    with pytest.raises(FleetStateError, match=r"holds no fleet file.*--fleet"):
        await asyncio.to_thread(fetch_fleet_config, nats_server.url, {})


def test_a_worker_without_fleet_or_url_is_told_what_to_pass() -> None:
    for module in ("lorafleet.sidecar", "lorafleet.serve"):
        out = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert "give --fleet FLEET.yaml, or --nats-url" in out.stderr


def test_a_fleet_file_from_nats_runs_no_program_without_the_hosts_consent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever can write the config bucket must not choose what a joining worker executes."""
    monkeypatch.delenv("LORAFLEET_TRUST_FLEET_EXEC", raising=False)
    plain = FleetConfig(bases=[BaseModelSpec(name="minilm", options={"max_loras": 4})])
    assert check_exec_consent(plain) is plain  # runtime settings that run nothing are fine
    for options in ({"venv": "/tmp/evil"}, {"extra_args": ["--trust-remote-code"]}):
        fleet = FleetConfig(bases=[BaseModelSpec(name="qwen", options=options)])
        with pytest.raises(FleetStateError, match=rf"sets bases\[qwen\]\.options\.{next(iter(options))}.*--fleet.*"
                                                  "LORAFLEET_TRUST_FLEET_EXEC=1"):
            check_exec_consent(fleet)
        assert check_exec_consent(fleet, allow=True) is fleet
        monkeypatch.setenv("LORAFLEET_TRUST_FLEET_EXEC", "1")
        assert check_exec_consent(fleet) is fleet
        monkeypatch.delenv("LORAFLEET_TRUST_FLEET_EXEC")
