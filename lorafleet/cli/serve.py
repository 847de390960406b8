"""`lorafleet up`, `down`, `status`, `embed`, `rerank`: the local cluster and a client for it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import typer

from lorafleet.cli.status import status
from lorafleet.core.settings import DEFAULT_FLEET


def _fail(message: str, code: int = 1) -> NoReturn:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


def up(
    workers: int | None = typer.Option(None, "--workers", "-w", min=0, show_default=False, help="Worker processes to "
                                "start. Default: on a CPU host, one single-threaded worker per CPU (at most 4; on 2 "
                                "CPUs two served 1.1-1.3x the requests of one with both threads, for 2-4 ms more "
                                "on a lone request); one where the host has a GPU or a base runs on its own engine "
                                "(vllm)."),
    port: int = typer.Option(None, "--port", "-p", help="Gateway port (default: the fleet's, 8080)."),
    fleet: Path = typer.Option(None, "--fleet", "-f", help="Fleet YAML (default: configs/fleet.yaml if present)."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return once ready; a supervisor keeps the cluster "
                                "running (and restarts what dies) until `lorafleet down`."),
    timeout: float = typer.Option(300.0, help="Seconds to wait for the cluster to become ready."),
    tls: bool = typer.Option(False, "--tls", help="TLS on NATS connections, with a private CA made under "
                             "LORAFLEET_HOME/tls (give remote workers its ca.pem)."),
    insecure_no_auth: bool = typer.Option(False, "--insecure-no-auth", help="Run nats-server WITHOUT "
                                          "authentication: anyone who reaches it owns the fleet. Loopback tests only."),
    home: Path = typer.Option(None, "--home", help="LORAFLEET_HOME for this cluster (default: $LORAFLEET_HOME)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address nats-server and the gateway listen on (0.0.0.0: "
                             "every interface, for workers on other hosts: keep authentication on, add --tls)."),
    worker_threads: int = typer.Option(None, "--worker-threads", min=1, help="torch threads per worker (default: "
                                       "the fleet's worker.threads, else OMP_NUM_THREADS, else this host's CPUs "
                                       "divided among the workers; the gateway always uses one)."),
    nats_nodes: int = typer.Option(1, "--nats-nodes", min=1, help="nats-server processes: 1, or 3 (or more) for "
                                   "a JetStream cluster on this host (routes on --host, authenticated; one store "
                                   "each) whose streams and fleet bucket keep 3 replicas (the fleet's "
                                   "nats.replicas), so the fleet keeps serving when a node dies. Workers and "
                                   "the gateway get every node's URL (--nats-url a,b,c) and fail over."),
) -> None:
    """Start a local cluster: nats-server (authentication on), N workers and the gateway, supervised."""
    from lorafleet.core import settings
    from lorafleet.core.config import ConfigError
    from lorafleet.core.plugins import PluginError
    from lorafleet.ops.cluster import ClusterError, LocalCluster, default_workers, load_fleet

    if home is not None:
        os.environ["LORAFLEET_HOME"] = str(home.expanduser().resolve())
    if fleet is None and DEFAULT_FLEET.is_file():
        fleet = DEFAULT_FLEET
    if detach:
        _up_detached(workers, port, fleet, timeout, tls, insecure_no_auth, settings.home(), host, worker_threads,
                     nats_nodes)
        return
    try:
        cfg = load_fleet(fleet)
        why = "set with --workers"
        if workers is None:
            workers, why = default_workers(cfg, worker_threads)
        cluster = LocalCluster(cfg, workers=workers, port=port, host=host, auth=not insecure_no_auth, tls=tls,
                               supervise=True,
                               on_event=lambda text: typer.secho(text, err=True, fg=typer.colors.YELLOW),
                               supervisor_pid=os.getpid(), worker_threads=worker_threads, nats_nodes=nats_nodes)
        t0 = time.monotonic()
        cluster.start(timeout=timeout, progress=True)
    except (ConfigError, ClusterError, PluginError) as exc:
        _fail(str(exc))
        return
    names = ", ".join([b.name for b in cfg.bases] + [m.name for m in cfg.models])
    typer.echo(f"lorafleet is ready in {time.monotonic() - t0:.1f}s: gateway {cluster.gateway_url}  (serving: {names})")
    typer.echo(f"  NATS {cluster.nats_url}: " + (f"credentials in {cluster.home / 'creds'}" if not insecure_no_auth
                                                   else "NO AUTHENTICATION (--insecure-no-auth)"))
    typer.echo(f"  try: lorafleet embed --model {cfg.bases[0].name} 'Der Käufer zahlt den Kaufpreis.'")
    typer.echo(f"  workers: {workers} ({why}); threads: {cluster.threads.describe()}")
    typer.echo(f"  state and logs: {cluster.home}")
    typer.echo("  press Ctrl-C to stop")
    stop = {"now": False}

    def _on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        while not stop["now"]:
            time.sleep(0.2)
    finally:
        typer.echo("stopping (workers finish what they hold)…")
        cluster.stop()
        typer.echo("stopped")


def _up_detached(workers: int | None, port: int | None, fleet: Path | None, timeout: float, tls: bool, insecure: bool,
                 home: Path, host: str, worker_threads: int | None, nats_nodes: int = 1) -> None:
    """`up` again in its own session (the supervisor, logging to logs/supervisor.log); return once it is ready."""
    import subprocess

    from lorafleet.ops.cluster import ClusterError, ClusterState

    argv = [sys.executable, "-m", "lorafleet.cli", "up", "--home", str(home), "--timeout", str(timeout),
            "--host", host]
    argv += ["--workers", str(workers)] if workers is not None else []
    if port is not None:
        argv += ["--port", str(port)]
    if fleet is not None:
        argv += ["--fleet", str(fleet.resolve())]
    argv += ["--tls"] if tls else []
    argv += ["--worker-threads", str(worker_threads)] if worker_threads else []
    argv += ["--nats-nodes", str(nats_nodes)] if nats_nodes != 1 else []
    argv += ["--insecure-no-auth"] if insecure else []
    (home / "logs").mkdir(parents=True, exist_ok=True)
    log_path = home / "logs" / "supervisor.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "LORAFLEET_HOME": str(home)})
    deadline = time.monotonic() + timeout + 30.0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            _fail(f"the cluster did not start (exit code {proc.returncode}); {log_path}:\n{tail}")
        try:
            state = ClusterState.load(home)
            if state.ready and state.supervisor_pid == proc.pid:
                typer.echo(f"lorafleet is ready: gateway {state.gateway_url}, NATS {state.nats_url}"
                           f"{'' if state.auth else ' (NO AUTHENTICATION)'}")
                typer.echo(f"  supervisor pid {proc.pid} (log {log_path}); stop with: lorafleet down")
                return
        except (ClusterError, ValueError, OSError):
            pass
        time.sleep(0.2)
    _fail(f"the cluster was not ready within {timeout:.0f}s; see {log_path}")


def down(timeout: float = typer.Option(30.0, help="Seconds workers get to finish in-flight tasks.")) -> None:
    """Stop the local cluster: its supervisor, then whatever of it still runs (found by command line)."""
    from lorafleet.ops.cluster import ClusterError
    from lorafleet.ops.cluster import down as cluster_down

    try:
        stopped = cluster_down(timeout=timeout)
    except ClusterError as exc:
        _fail(str(exc))
        return
    typer.echo(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")


def _call_gateway(url: str | None, path: str, body: dict[str, object], api_key: str | None,
                  timeout: float) -> dict[str, Any]:
    """POST `body` to the gateway (the local cluster's unless `url` is given) and return the JSON answer;
    an unreachable gateway or an error answer ends the command with the gateway's code and message."""
    import httpx

    from lorafleet.core import settings
    from lorafleet.ops.cluster import ClusterError, ClusterState

    if url is None:
        try:
            url = ClusterState.load(settings.home()).gateway_url
        except ClusterError:
            url = os.environ.get("LORAFLEET_URL", "http://127.0.0.1:8080")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(f"{url.rstrip('/')}{path}", json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        _fail(f"cannot reach the gateway at {url}: {exc} (is the cluster up? `lorafleet up`)")
    if r.status_code != 200:
        try:
            err = r.json()["error"]
            message = f"{r.status_code} {err.get('code')}: {err.get('message')}"
        except (ValueError, KeyError, TypeError):
            message = f"{r.status_code}: {r.text[:500]}"
        _fail(message)
    answer: dict[str, Any] = r.json()
    return answer


def embed(
    texts: list[str] = typer.Argument(..., help="Texts to embed."),
    model: str = typer.Option(..., "--model", "-m", help="Served name: a base model or a promoted bundle, or "
                              "NAME@N for exactly version N of it (what production indexes pin)."),
    url: str = typer.Option(None, "--url", help="Gateway URL (default: the local cluster's, else :8080)."),
    as_json: bool = typer.Option(False, "--json", help="Print the full OpenAI-style JSON response."),
    api_key: str = typer.Option(None, "--api-key", envvar="LORAFLEET_API_KEY", help="Bearer key, if set."),
    timeout: float = typer.Option(60.0, help="Seconds to wait for the answer."),
) -> None:
    """Embed TEXTs through the gateway and print the vectors."""
    body = _call_gateway(url, "/v1/embeddings", {"model": model, "input": texts}, api_key, timeout)
    if as_json:
        typer.echo(json.dumps(body))
        return
    for item in body["data"]:
        vec = item["embedding"]
        head = ", ".join(f"{v:+.4f}" for v in vec[:8])
        typer.echo(f"[{item['index']}] dim={len(vec)}  [{head}, …]  {texts[item['index']][:60]!r}")
    typer.echo(f"model {body['model']}, {body['usage']['prompt_tokens']} prompt tokens", err=True)
    sys.stdout.flush()


def rerank(
    query: str = typer.Argument(..., help="The query to rank the documents against."),
    documents: list[str] = typer.Argument(..., help="Documents to rank."),
    model: str = typer.Option(..., "--model", "-m", help="Served name of a reranker: a promoted rerank specialist, "
                              "or a cross-encoder base whose checkpoint ships its score head (a base whose head is "
                              "drawn at load, as the default fleet's all-MiniLM-L6-v2-ce, is refused with what to "
                              "do)."),
    top_n: int = typer.Option(None, "--top-n", help="Print only the N best documents."),
    url: str = typer.Option(None, "--url", help="Gateway URL (default: the local cluster's, else :8080)."),
    as_json: bool = typer.Option(False, "--json", help="Print the full JSON response."),
    api_key: str = typer.Option(None, "--api-key", envvar="LORAFLEET_API_KEY", help="Bearer key, if set."),
    timeout: float = typer.Option(60.0, help="Seconds to wait for the answer."),
) -> None:
    """Rank DOCUMENTs by relevance to QUERY through the gateway (POST /v1/rerank), best first."""
    body: dict[str, object] = {"model": model, "query": query, "documents": documents}
    if top_n is not None:
        body["top_n"] = top_n
    answer = _call_gateway(url, "/v1/rerank", body, api_key, timeout)
    if as_json:
        typer.echo(json.dumps(answer))
        return
    for item in answer["results"]:
        typer.echo(f"[{item['index']}] {item['relevance_score']:.4f}  {documents[item['index']][:70]!r}")
    truncated = answer.get("truncated") or []
    note = f"; document(s) {truncated} truncated to the model's length" if truncated else ""
    typer.echo(f"model {answer['model']}, {answer['usage']['total_tokens']} tokens{note}", err=True)
    sys.stdout.flush()


_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def worker(ctx: typer.Context) -> None:
    """Run one worker in the foreground (e.g. on another host): the options of `python -m lorafleet.sidecar`
    (--fleet, --nats-url, --creds, --tls-ca, …; --help lists them)."""
    from lorafleet.sidecar.__main__ import main

    raise typer.Exit(main(list(ctx.args)))


def gateway(ctx: typer.Context) -> None:
    """Run one gateway in the foreground: the options of `python -m lorafleet.serve` (--help lists them)."""
    from lorafleet.serve.__main__ import main

    raise typer.Exit(main(list(ctx.args)))


def layout(ctx: typer.Context) -> None:
    """Apply the NATS layout with the admin credential, then re-create any stream or bucket that is lost (what
    `lorafleet up` does in its own process): the options of `python -m lorafleet.ops.layout` (--help lists them)."""
    from lorafleet.ops.layout import main

    raise typer.Exit(main(list(ctx.args)))


def register(app: typer.Typer) -> None:
    app.command("worker", context_settings=_PASS_THROUGH)(worker)
    app.command("gateway", context_settings=_PASS_THROUGH)(gateway)
    app.command("layout", context_settings=_PASS_THROUGH)(layout)
    app.command("up")(up)
    app.command("down")(down)
    app.command("status")(status)
    app.command("rerank")(rerank)
    app.command("embed")(embed)
