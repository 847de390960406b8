"""`lorafleet status`: the cluster as NATS sees it, from this host or any other.

Every worker and gateway says on NATS that it runs (`heartbeats.Presence`: role, host, pid, state,
restarts), so `status --nats-url URL --creds FILE` shows a whole cluster from a host that runs none
of it. With a local cluster (`lorafleet up`) the URL and the control credential come from
LORAFLEET_HOME, and the local processes (supervisor, nats-server) are shown too; when NATS cannot be
reached, only those are, and the output says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer


def status(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    nats_url: str = typer.Option(None, "--nats-url", help="NATS server URL (or a "
                                 "cluster's, comma-separated); default: the local cluster's."),
    creds: Path = typer.Option(None, "--creds", help="Credential file with the control role (default: "
                               "$LORAFLEET_NATS_CREDS, else the local cluster's creds/control.nk)."),
    tls_ca: Path = typer.Option(None, "--tls-ca", help="CA of the server's certificate ($LORAFLEET_NATS_TLS_CA)."),
    fleet: Path = typer.Option(None, "--fleet", "-f", help="Fleet YAML, for the queue's stream name (default: the "
                               "local cluster's, else lorafleet's defaults)."),
    listen: float = typer.Option(1.5, "--listen", min=0.1, help="Seconds to listen for heartbeats (every process "
                                 "speaks once a second)."),
) -> None:
    """The cluster read from NATS — each process's role, host, pid, state and restarts; workers, adapters,
    queue depth and consumer lag — plus the local processes of a cluster started here."""
    import asyncio

    from lorafleet.cli import echo_home
    from lorafleet.core import settings
    from lorafleet.core.config import ConfigError, FleetConfig, load_yaml_model
    from lorafleet.nats.auth import CredentialsError
    from lorafleet.nats.client import ClientSettings, NatsUrlError
    from lorafleet.ops.cluster_state import STATE_FILE, ClusterError, ClusterState, collect_status, processes

    echo_home()
    home = settings.home()
    try:
        state = ClusterState.load(home) if (home / STATE_FILE).is_file() else None
        fleet_file = fleet or (Path(state.fleet_file) if state is not None else None)
        cfg = load_yaml_model(FleetConfig, fleet_file) if fleet_file is not None else FleetConfig()
    except (ClusterError, ConfigError, OSError, ValueError) as exc:
        _fail(str(exc))
        return
    if state is None and not nats_url:
        _fail(f"no local cluster is recorded under {home}: pass --nats-url (and --creds with the control role) "
              "to read a cluster from NATS, or start one with `lorafleet up`")
        return
    client = None
    if creds is not None or tls_ca is not None:
        client = ClientSettings.resolve(creds=creds, tls_ca=tls_ca,
                                        fallback_creds=state.creds_path("control") if state is not None else None)
    try:
        info = asyncio.run(collect_status(state, cfg, listen, client=client, nats_url=nats_url))
    except (ClusterError, CredentialsError, NatsUrlError, OSError, TimeoutError) as exc:
        if state is None:
            _fail(f"cannot read the cluster from NATS: {exc}")
            return
        info = {"source": "local", "note": f"NATS unreachable ({exc}); showing the local processes only",
                "cluster": {}, "workers": {}, "queue": {"error": str(exc)}}
    if info.get("source") == "nats":
        info["canaries"] = _canaries(info["nats_url"], state, client)
        info["shadows"] = _canaries(info["nats_url"], state, client, shadows=True)
        if isinstance(info["canaries"], list) and info["canaries"]:
            from lorafleet.registry.canary import watch_line

            for c in info["canaries"]:  # who watches: the spec's watcher, only while it is heard and its window runs
                c["watch"] = watch_line(c, info.get("cluster") or {})
            _route_keys(info["nats_url"], state, client, info["canaries"], listen)
    if state is not None:
        info["processes"] = processes(home, state)
        info["gateway_url"] = state.gateway_url
    if as_json:
        typer.echo(json.dumps(info, indent=2, default=str))
        return
    _print(info, state)


def _canaries(url: str, state: Any, client: Any, shadows: bool = False) -> list[dict[str, Any]] | dict[str, str]:
    """Each canary's split (or each shadow with its figures so far) from the fleet state (issue 25); {"error": …}
    when it cannot be read."""
    import asyncio

    from lorafleet.registry.canary import read_canaries
    from lorafleet.registry.promote import control_client
    from lorafleet.registry.shadow import read_shadows

    try:
        read = read_shadows if shadows else read_canaries
        return asyncio.run(read(url, client or control_client(state)))
    except Exception as exc:  # the rest of the status is still worth showing
        return {"error": str(exc)}


# A canary splits by route key: when one key carries most of its requests (every client behind one proxy that
# uvicorn does not trust, say), its share is 0 % or 100 % of that traffic, whatever the percentage (issue 38).
ONE_KEY_SHARE = 0.5
ONE_KEY_MIN_REQUESTS = 20  # fewer requests say nothing about how keys spread


def route_key_line(figures: dict[str, Any] | None) -> str | None:
    """The warning for a canary's route-key figures (`_route_keys`), or None when its keys spread."""
    if not figures or figures["requests"] < ONE_KEY_MIN_REQUESTS or figures["top_share"] <= ONE_KEY_SHARE:
        return None
    fix = {"address": "clients share an address: behind a proxy, start the gateway with --forwarded-allow-ips "
                      "<the proxy's address>, or have clients send X-Lorafleet-Route-Key or their own API keys",
           "api-key": "clients share one API key: give each client its own, or have them send X-Lorafleet-Route-Key",
           "header": "clients send the same X-Lorafleet-Route-Key: make it per user or per session"}
    return (f"one route key ({figures['top_source']}) carries {100 * figures['top_share']:.0f} % of the "
            f"{figures['requests']} requests the split decided, so this canary gets 0 % or 100 % of them; "
            f"{fix.get(figures['top_source'], fix['address'])}")


def _route_keys(url: str, state: Any, client: Any, canaries: list[dict[str, Any]], listen_s: float) -> None:
    """Each canary's requests by route key as the gateways counted them (their stats messages), and the warning
    when one key carries most of them: `route_keys` and `route_key_warning` on each canary's dict."""
    import asyncio

    from lorafleet.registry.promote import control_client
    from lorafleet.serve.routekeys import busiest_share

    try:
        latest = asyncio.run(_gateway_stats(url, client or control_client(state), listen_s))
    except Exception as exc:  # the rest of the status is still worth showing
        for c in canaries:
            c["route_keys"] = {"error": str(exc)}
        return
    for c in canaries:
        busiest = busiest_share([t for s in latest.values()
                                 if (t := s.route_keys.get((c["name"], str(c["canary"])))) is not None])
        if busiest is None:
            c["route_keys"] = None
            continue
        share, source, requests = busiest
        c["route_keys"] = {"requests": requests, "top_share": round(share, 4), "top_source": source}
        c["route_key_warning"] = route_key_line(c["route_keys"])


async def _gateway_stats(url: str, client: Any, listen_s: float) -> dict[str, Any]:
    """The latest stats message of every gateway heard within `listen_s` (each speaks once a second)."""
    import asyncio

    import nats

    from lorafleet.core.heartbeats import GatewayStats, subscribe_stats
    from lorafleet.nats.client import server_urls

    latest: dict[str, GatewayStats] = {}

    def keep(stats: GatewayStats) -> None:
        if stats.gateway not in latest or latest[stats.gateway].ts <= stats.ts:
            latest[stats.gateway] = stats

    nc = await asyncio.wait_for(nats.connect(server_urls(url), connect_timeout=2, max_reconnect_attempts=0,
                                             allow_reconnect=False, **client.options()), 6.0)
    try:
        await subscribe_stats(nc, keep)
        await asyncio.sleep(listen_s)  # listening is the point
    finally:
        await nc.drain()
    return latest


def _fail(message: str, code: int = 1) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


def _print(info: dict[str, Any], state: Any) -> None:
    if state is not None:
        typer.echo(f"gateway {state.gateway_url}   nats {state.nats_url}"
                   f"{'' if state.auth else '  (no authentication)'}")
    if info.get("note"):
        typer.secho(info["note"], err=True, fg=typer.colors.YELLOW)
    else:
        typer.echo(f"cluster (from NATS {info['nats_url']}):")
        if not info["cluster"]:
            typer.echo("  no process heard")
        for p in info["cluster"].values():
            typer.echo(f"  {p['role']:<8} {p['name']:<20} {p['host']:<16} pid {p['pid']:<8} {p['state']:<10} "
                       f"restarts {p['restarts']}")
    if "processes" in info:
        typer.echo("local processes:")
        for name, p in info["processes"].items():
            restarts = f"  restarted {p['restarts']}x (last exit {p['last_exit']})" if p["restarts"] else ""
            typer.echo(f"  {name:<14} " + (f"pid {p['pid']:<8} running" if p["alive"] else f"{'':<12} stopped")
                       + restarts)
    if info["source"] != "nats":
        return
    typer.echo("workers (from heartbeats):")
    if not info["workers"]:
        typer.echo("  none heard")
    for name, hb in info["workers"].items():
        adapters = ", ".join(f"{b}: {a}" for b, a in hb["adapters"].items() if a) or "none"
        rates = ", ".join(f"{b} {r:.0f}/s" for b, r in hb.get("service_rates", {}).items()) or "not measured"
        precision = ", ".join(f"{b} {p}" for b, p in hb.get("precisions", {}).items()) or "not reported"
        engines = "".join(f"  {b}: {hb['slots_used'].get(b, 0)}/{n} sequences, KV cache "
                          f"{100 * hb.get('kv_cache', {}).get(b, 0.0):.0f}%" for b, n in hb.get("slots", {}).items())
        typer.echo(
            f"  {name:<14} bases {', '.join(hb['bases']) or '(none pulling)'}  adapters {adapters}  in flight "
            f"{hb['in_flight']}  {hb['batches_per_s']:.1f} batches/s  rate {rates}  precision {precision}  done "
            f"{hb['tasks_done']}"
            f"{engines}{'  draining' if hb['draining'] else ''}"
        )
    canaries = info.get("canaries", [])
    if canaries:
        typer.echo("canaries (from the fleet state):")
    if isinstance(canaries, dict):
        typer.echo(f"  unavailable: {canaries['error']}")
    for c in canaries if isinstance(canaries, list) else ():
        watch = c.get("watch", "nobody watches")
        typer.echo(f"  {c['name']:<20} champion v{c['champion']} {c['champion_percent']:g} %  canary v{c['canary']} "
                   f"{c['percent']:g} %  {watch}")
        if c.get("route_key_warning"):
            typer.secho(f"    warning: {c['route_key_warning']}", err=True, fg=typer.colors.YELLOW)
    shadows = info.get("shadows", [])
    if shadows:
        typer.echo("shadows (from the fleet state; figures from the gateways so far):")
    if isinstance(shadows, dict):
        typer.echo(f"  unavailable: {shadows['error']}")
    for s in shadows if isinstance(shadows, list) else ():
        f = s.get("figures", {})
        figures = "  ".join(f"{k.removeprefix('online_')} {v:.4g}" for k, v in sorted(f.items())) or "no figures yet"
        typer.echo(f"  {s['name']:<20} champion v{s['champion']} answers all; shadow v{s['shadow']} gets copies of "
                   f"{s['percent']:g} %  {figures}")
    typer.echo("queue (per consumer):")
    queue = info["queue"]
    if "error" in queue:
        typer.echo(f"  unavailable: {queue['error']}")
    for consumer, q in queue.items():
        if consumer == "error":
            continue
        typer.echo(f"  {consumer:<30} waiting {q['pending']}  unacked {q['ack_pending']}  "
                   f"redelivered {q['redelivered']}")
