"""Which route key split a canary's traffic (issue 38, item 8): the response header, the gateway's per-key tally in
its stats message, and `lorafleet status`'s warning when one key carries most of a canary's requests (every
client behind one proxy that uvicorn does not trust has the proxy's address)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from serve_harness import BASE, make_fleet, running_gateway, scripted_worker, wait_ready

from lorafleet.cli.status import route_key_line
from lorafleet.core.fleet_state import FleetEntry, canary_spec, ensure_fleet_bucket, put_entry
from lorafleet.core.heartbeats import GatewayStats, RouteKeys, VersionCounts
from lorafleet.nats.client import ClientSettings
from lorafleet.serve.resolver import Resolver, route_key
from lorafleet.serve.routekeys import ROUTE_KEY_SOURCE_HEADER, RouteKeyTally, busiest_share, routed_by

NAME = "legal"


def _entry(version: str) -> FleetEntry:
    return FleetEntry(name=NAME, base=BASE, adapter_id=f"{NAME}@v{version}", adapter_uri=f"models:/{NAME}/{version}",
                      version=version, registered_model=NAME)


CANARY = _entry("1").model_copy(update={"canary": canary_spec(_entry("2"), 50.0)})


def test_the_header_names_the_source_only_where_a_split_decided() -> None:
    r = Resolver([BASE])
    r.set_models([CANARY.served_model()], entries=[CANARY])
    tally = RouteKeyTally()
    secret = "sk-live-0123456789"
    for header, auth, source in (("user-7", f"Bearer {secret}", "header"), (None, f"Bearer {secret}", "api-key"),
                                 (None, None, "address")):
        assert routed_by(r, tally, NAME, route_key(header, auth, "10.0.0.1")) == {ROUTE_KEY_SOURCE_HEADER: source}
    assert routed_by(r, tally, BASE, route_key(None, None, "10.0.0.1")) == {}  # no canary on the base
    assert routed_by(r, tally, f"{NAME}@2", route_key(None, None, "10.0.0.1")) == {}  # pinned: never split
    assert routed_by(r, tally, NAME, None) == {}
    (keys,) = tally.snapshot().values()
    assert tally.snapshot().keys() == {(NAME, "2")} and keys.requests == 3 and keys.keys == 3
    assert not any(secret in d or "user-7" in d for d, _, _ in keys.top)  # digests of keys, never the keys


def test_the_tally_is_bounded_and_ranks_the_busiest_key() -> None:
    tally = RouteKeyTally(kept=2)
    for key, n in (("a:x", 5), ("k:y", 2), ("h:z", 9)):  # z arrives past the bound: counted in the total only
        for _ in range(n):
            tally.add(NAME, "2", key)
    keys = tally.snapshot()[(NAME, "2")]
    assert (keys.requests, keys.keys) == (16, 2)
    assert [(s, c) for _, s, c in keys.top] == [("address", 5), ("api-key", 2)]


def test_status_warns_when_one_key_carries_most_of_the_canary() -> None:
    one = RouteKeys(30, 2, (("d1", "address", 28), ("d2", "header", 2)))
    other = RouteKeys(10, 1, (("d1", "address", 10),))  # the same proxy address seen by a second gateway
    share, source, requests = busiest_share([one, other])  # type: ignore[misc]
    assert (round(share, 3), source, requests) == (0.95, "address", 40)
    line = route_key_line({"requests": requests, "top_share": share, "top_source": source})
    assert line is not None and "95 %" in line and "--forwarded-allow-ips" in line
    spread = RouteKeys(40, 40, (("d1", "address", 1), ("d2", "address", 1)))
    assert route_key_line({"requests": 40, "top_share": busiest_share([spread])[0], "top_source": "address"}) is None
    assert route_key_line({"requests": 5, "top_share": 1.0, "top_source": "address"}) is None  # too few to say
    assert busiest_share([]) is None and busiest_share([RouteKeys()]) is None


def test_stats_carry_route_keys_and_an_older_gateway_without_them_still_parses() -> None:
    keys = {(NAME, "2"): RouteKeys(3, 1, (("d", "address", 3),))}
    stats = GatewayStats("g1", {(NAME, "2"): VersionCounts(3, 0)}, 5.0, keys)
    assert GatewayStats.from_wire(stats.to_wire()) == stats
    older = GatewayStats("g1", {(NAME, "2"): VersionCounts(3, 0)}, 5.0)
    assert GatewayStats.from_wire(older.to_wire()).route_keys == {}


def test_the_gateway_takes_forwarded_allow_ips() -> None:
    from lorafleet.serve.__main__ import parse_args
    from lorafleet.serve.routes import create_app, uvicorn_config

    assert parse_args(["--forwarded-allow-ips", "10.0.0.0/8"]).forwarded_allow_ips == "10.0.0.0/8"
    assert parse_args([]).forwarded_allow_ips is None  # uvicorn's default: $FORWARDED_ALLOW_IPS, else 127.0.0.1
    config = uvicorn_config(create_app(make_fleet("nats://127.0.0.1:1")), "127.0.0.1", 0,
                            forwarded_allow_ips="10.0.0.0/8")
    assert config.proxy_headers and config.forwarded_allow_ips == "10.0.0.0/8"


@pytest.mark.integration
async def test_one_address_for_every_client_is_named_and_warned_about(nats_server) -> None:
    """A real gateway and nats-server: the canary's responses say which key split them, its stats message
    counts the keys, and status's reading of it warns: every request came from one address."""
    import nats

    from lorafleet.cli.status import _route_keys

    fleet = make_fleet(nats_server.url)
    nc = await nats.connect(nats_server.url)
    try:
        await put_entry(await ensure_fleet_bucket(nc.jetstream()), CANARY)
    finally:
        await nc.close()
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client, \
                scripted_worker(nats_server.url, fleet.queue):
            await wait_ready(client, serving=True)
            for _ in range(250):
                if gw.gateway.resolver.has_splits:
                    break
                await asyncio.sleep(0.02)
            body = {"model": NAME, "input": "x"}
            r = await client.post("/v1/embeddings", json=body, headers={"X-Lorafleet-Route-Key": "user-1"})
            assert r.status_code == 200 and r.headers[ROUTE_KEY_SOURCE_HEADER] == "header", r.text
            r = await client.post("/v1/embeddings", json=body, headers={"Authorization": "Bearer sk-never-echoed"})
            assert r.headers[ROUTE_KEY_SOURCE_HEADER] == "api-key"
            assert not any("sk-never-echoed" in v for v in r.headers.values())
            r = await client.post("/v1/embeddings", json={"model": BASE, "input": "x"})
            assert ROUTE_KEY_SOURCE_HEADER not in r.headers  # no canary on the base: no key decided anything
            sources = set()
            for _ in range(25):  # every client behind one untrusted proxy: one address
                r = await client.post("/v1/embeddings", json=body)
                sources.add(r.headers[ROUTE_KEY_SOURCE_HEADER])
            assert sources == {"address"}
            canaries = [{"name": NAME, "canary": "2"}]
            await asyncio.to_thread(_route_keys, nats_server.url, None, ClientSettings(), canaries, 1.5)
    figures = canaries[0]["route_keys"]
    assert figures["requests"] == 27 and figures["top_source"] == "address", figures
    assert "--forwarded-allow-ips" in canaries[0]["route_key_warning"]
