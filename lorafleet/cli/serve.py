"""`lorafleet up`, `down`, `status`, `embed`: the local cluster and a client for it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import typer

DEFAULT_FLEET = Path("configs/fleet.yaml")


def _fail(message: str, code: int = 1) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


def up(
    workers: int = typer.Option(1, "--workers", "-w", min=0, help="Worker processes to start."),
    port: int = typer.Option(None, "--port", "-p", help="Gateway port (default: the fleet's, 8080)."),
    fleet: Path = typer.Option(None, "--fleet", "-f", help="Fleet YAML (default: configs/fleet.yaml if present)."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return once ready; stop later with `lorafleet down`."),
    timeout: float = typer.Option(300.0, help="Seconds to wait for the cluster to become ready."),
) -> None:
    """Start a local cluster: embedded nats-server, N workers and the gateway, under LORAFLEET_HOME."""
    from lorafleet.cluster import ClusterError, LocalCluster, load_fleet
    from lorafleet.config import ConfigError

    if fleet is None and DEFAULT_FLEET.is_file():
        fleet = DEFAULT_FLEET
    try:
        cfg = load_fleet(fleet)
        cluster = LocalCluster(cfg, workers=workers, port=port)
        t0 = time.monotonic()
        cluster.start(timeout=timeout, progress=True)
    except (ConfigError, ClusterError) as exc:
        _fail(str(exc))
        return
    names = ", ".join([b.name for b in cfg.bases] + [m.name for m in cfg.models])
    typer.echo(f"lorafleet is ready in {time.monotonic() - t0:.1f}s: gateway {cluster.gateway_url}  (serving: {names})")
    typer.echo(f"  try: lorafleet embed --model {cfg.bases[0].name} 'Der Käufer zahlt den Kaufpreis.'")
    typer.echo(f"  state and logs: {cluster.home}")
    if detach:
        cluster.detach()  # the parts run in their own sessions and outlive this process
        typer.echo("  detached; stop with: lorafleet down")
        return
    typer.echo("  press Ctrl-C to stop")
    stop = {"now": False}

    def _on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        while not stop["now"]:
            time.sleep(0.5)
            for name, code in cluster.exited():
                typer.secho(f"{name} exited with code {code}; see {cluster.log_path(name)}",
                            err=True, fg=typer.colors.YELLOW)
    finally:
        typer.echo("stopping (workers finish what they hold)…")
        cluster.stop()
        typer.echo("stopped")


def down(timeout: float = typer.Option(30.0, help="Seconds workers get to finish in-flight tasks.")) -> None:
    """Stop the local cluster started with `lorafleet up --detach`."""
    from lorafleet.cluster import ClusterError
    from lorafleet.cluster import down as cluster_down

    try:
        stopped = cluster_down(timeout=timeout)
    except ClusterError as exc:
        _fail(str(exc))
        return
    typer.echo(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")


def status(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Workers, models, adapters, queue depth and consumer lag of the local cluster."""
    import asyncio

    from lorafleet import settings
    from lorafleet.cluster import ClusterError, ClusterState, collect_status, pid_alive
    from lorafleet.config import FleetConfig, load_yaml_model

    try:
        state = ClusterState.load(settings.home())
        fleet = load_yaml_model(FleetConfig, state.fleet_file)
        info = asyncio.run(collect_status(state, fleet))
    except ClusterError as exc:
        _fail(str(exc))
        return
    except (OSError, TimeoutError) as exc:
        _fail(f"cannot reach nats-server at {state.nats_url}: {exc}")
        return
    info["processes"] = {name: {"pid": pid, "alive": pid_alive(pid)} for name, pid in state.pids.items()}
    info["gateway_url"] = state.gateway_url
    if as_json:
        typer.echo(json.dumps(info, indent=2, default=str))
        return
    typer.echo(f"gateway {state.gateway_url}   nats {state.nats_url}")
    typer.echo("processes:")
    for name, p in info["processes"].items():
        typer.echo(f"  {name:<14} pid {p['pid']:<8} {'running' if p['alive'] else 'stopped'}")
    typer.echo("workers (from heartbeats):")
    if not info["workers"]:
        typer.echo("  none seen in the last 1.5 s")
    for name, hb in info["workers"].items():
        adapters = ", ".join(f"{b}: {a}" for b, a in hb["adapters"].items() if a) or "none"
        typer.echo(
            f"  {name:<14} bases {', '.join(hb['bases'])}  adapters {adapters}  in flight {hb['in_flight']}  "
            f"{hb['batches_per_s']:.1f} batches/s  done {hb['tasks_done']}{'  draining' if hb['draining'] else ''}"
        )
    typer.echo("queue (per consumer):")
    queue = info["queue"]
    if "error" in queue:
        typer.echo(f"  unavailable: {queue['error']}")
    for consumer, q in queue.items():
        if consumer == "error":
            continue
        typer.echo(f"  {consumer:<30} waiting {q['pending']}  unacked {q['ack_pending']}  "
                   f"redelivered {q['redelivered']}")


def embed(
    texts: list[str] = typer.Argument(..., help="Texts to embed."),
    model: str = typer.Option(..., "--model", "-m", help="Served name: a base model or a promoted bundle."),
    url: str = typer.Option(None, "--url", help="Gateway URL (default: the local cluster's, else :8080)."),
    as_json: bool = typer.Option(False, "--json", help="Print the full OpenAI-style JSON response."),
    api_key: str = typer.Option(None, "--api-key", envvar="LORAFLEET_API_KEY", help="Bearer key, if set."),
    timeout: float = typer.Option(60.0, help="Seconds to wait for the answer."),
) -> None:
    """Embed TEXTs through the gateway and print the vectors."""
    import httpx

    from lorafleet import settings
    from lorafleet.cluster import ClusterError, ClusterState

    if url is None:
        try:
            url = ClusterState.load(settings.home()).gateway_url
        except ClusterError:
            url = os.environ.get("LORAFLEET_URL", "http://127.0.0.1:8080")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(f"{url.rstrip('/')}/v1/embeddings", json={"model": model, "input": texts},
                       headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        _fail(f"cannot reach the gateway at {url}: {exc} (is the cluster up? `lorafleet up`)")
        return
    if r.status_code != 200:
        try:
            err = r.json()["error"]
            _fail(f"{r.status_code} {err.get('code')}: {err.get('message')}")
        except (ValueError, KeyError):
            _fail(f"{r.status_code}: {r.text[:500]}")
        return
    body = r.json()
    if as_json:
        typer.echo(json.dumps(body))
        return
    for item in body["data"]:
        vec = item["embedding"]
        head = ", ".join(f"{v:+.4f}" for v in vec[:8])
        typer.echo(f"[{item['index']}] dim={len(vec)}  [{head}, …]  {texts[item['index']][:60]!r}")
    typer.echo(f"model {body['model']}, {body['usage']['prompt_tokens']} prompt tokens", err=True)
    sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("down")(down)
    app.command("status")(status)
    app.command("embed")(embed)
