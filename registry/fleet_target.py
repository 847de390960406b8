"""Which cluster a promotion talks to and how it connects: the fleet target, the control credential, NATS.

`find_fleet` reads --nats-url (and --fleet) or LORAFLEET_HOME/cluster.json into a FleetTarget: the URL, the bases
the fleet serves (else learnt from worker heartbeats), the heartbeat period, retention and precisions of the fleet
file. `open_fleet` is a connection and the fleet bucket for one block, closed after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.core import heartbeats, settings
from lorafleet.core.config import FleetConfig, load_yaml_model
from lorafleet.core.fleet_state import FleetStateError, Retention, open_fleet_bucket
from lorafleet.nats.auth import CREDS_SUFFIX, explain_connect_error
from lorafleet.nats.client import RECONNECT_OPTIONS, ClientSettings, server_urls
from lorafleet.nats.server import port_open
from lorafleet.ops.cluster import ClusterError, ClusterState
from lorafleet.registry.gate import PromotionError


@dataclass
class FleetTarget:
    nats_url: str
    bases: list[str] | None  # None: learnt from worker heartbeats when connected
    source: str
    client: ClientSettings = field(default_factory=ClientSettings)  # control: writing the fleet bucket is its job
    heartbeat_s: float = 1.0  # the workers' heartbeat period (the fleet file's), for how long preload listens
    retention: Retention = field(default_factory=Retention)  # the fleet file's gateway.retain_s/retain_versions
    precisions: dict[str, str] = field(default_factory=dict)  # base → the fleet file's `precision:` (issue 39)


def control_client(state: ClusterState | None = None, creds: Path | None = None) -> ClientSettings:
    """`creds`, else LORAFLEET_NATS_CREDS (and the TLS variables), else LORAFLEET_HOME/creds/control.nk; the
    cluster's CA unless one is set."""
    client = ClientSettings.resolve(creds=creds, fallback_creds=settings.home() / "creds" / f"control{CREDS_SUFFIX}")
    if client.tls is None and state is not None and state.tls:
        client = ClientSettings(client.creds, state.client(None).tls)
    return client


def find_fleet(nats_url: str | None = None, fleet_file: Path | None = None, creds: Path | None = None
               ) -> FleetTarget:
    """The cluster to publish to: --nats-url (and --fleet) if given, else LORAFLEET_HOME/cluster.json."""
    fleet: FleetConfig | None = None
    if fleet_file is not None:
        fleet = load_yaml_model(FleetConfig, fleet_file)
    if nats_url:
        return target_of(nats_url, fleet, "--nats-url", control_client(creds=creds))
    try:
        state = ClusterState.load(settings.home())
    except ClusterError as exc:
        raise PromotionError(f"{exc}; or name a running cluster with --nats-url") from exc
    if fleet is None:
        with contextlib.suppress(Exception):
            fleet = load_yaml_model(FleetConfig, state.fleet_file)
    return target_of(state.nats_url, fleet, str(settings.home() / "cluster.json"), control_client(state, creds))


def target_of(url: str, fleet: FleetConfig | None, source: str, client: ClientSettings) -> FleetTarget:
    if fleet is None:
        return FleetTarget(url, None, source, client)
    return FleetTarget(url, [b.name for b in fleet.bases], source, client, fleet.worker.heartbeat_s,
                       Retention(fleet.gateway.retain_s, fleet.gateway.retain_versions),
                       {b.name: b.precision for b in fleet.bases})


async def heartbeat_bases(nc: object, wait_s: float = 2.5) -> list[str]:
    """The bases that live workers serve, from the first heartbeat(s) heard within `wait_s`."""
    seen = await heartbeats.collect(nc, wait_s, until=bool)
    return sorted({b for hb in seen.values() for b in hb.bases})


async def connect(url: str, client: ClientSettings | None = None, *, lasting: bool = False) -> object:
    """A NATS connection that fails fast: nats-py keeps retrying a refused first connect on its own. `lasting`
    (the canary watch, which guards for minutes): the gateway's and workers' pings and reconnects
    (RECONNECT_OPTIONS), so a server that goes silent is noticed within seconds and another node taken."""
    from urllib.parse import urlsplit

    import nats

    # A cluster's URL lists its nodes: connect to one that listens.
    servers = [u for u in server_urls(url)
               if port_open(urlsplit(u).hostname or "127.0.0.1", urlsplit(u).port or 4222, timeout=2.0)]
    if not servers:
        raise FleetStateError(f"cannot reach nats-server at {url}: nothing listens there (is the cluster up?)")

    async def _quiet(exc: Exception) -> None:
        return None

    options = (client or ClientSettings()).options()
    keep = {"allow_reconnect": True, **RECONNECT_OPTIONS} if lasting else \
        {"allow_reconnect": False, "max_reconnect_attempts": 0}
    try:
        return await asyncio.wait_for(nats.connect(servers, connect_timeout=3, error_cb=_quiet, **keep, **options),
                                      timeout=6.0)
    except Exception as exc:
        raise FleetStateError(explain_connect_error(exc, url)) from exc


@contextlib.asynccontextmanager
async def open_fleet(nats_url: str, client: ClientSettings | None = None, *, lasting: bool = False
                     ) -> AsyncIterator[tuple[Any, Any]]:
    """(connection, fleet bucket) for the block, the connection closed after it (`lasting`: see `connect`)."""
    nc: Any = await connect(nats_url, client, lasting=lasting)
    try:
        yield nc, await open_fleet_bucket(nc.jetstream())
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


async def fleet_bases(nc: object, target: FleetTarget) -> list[str]:
    bases = target.bases if target.bases is not None else await heartbeat_bases(nc)
    if not bases:
        raise PromotionError("cannot tell which base models the fleet serves: no fleet file and no worker "
                             "heartbeat; pass --fleet FLEET.yaml")
    return bases


def target_retention(target: FleetTarget, retention: Retention | None,
                    changes: dict[str, float | int | None] | None = None) -> FleetTarget:
    """`retention` replaces the fleet file's; `changes` (`--retain`, `--retain-versions`) replace single fields."""
    chosen = retention if retention is not None else target.retention
    return dataclasses.replace(target, retention=dataclasses.replace(chosen, **(changes or {})))  # type: ignore[arg-type]


__all__ = ["FleetTarget", "connect", "control_client", "find_fleet", "fleet_bases", "heartbeat_bases", "open_fleet",
           "target_of", "target_retention"]
