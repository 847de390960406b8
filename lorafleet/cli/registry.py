"""`lorafleet registry list`, `promote`, `rollback`, `ui`: bundles, the quality gate, live promotion, the MLflow UI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from lorafleet.registry.precision_notice import PrecisionNotice
    from lorafleet.registry.promote import Agreement, Preload

from lorafleet.cli.promotion import _errors, _fail, client_notes

registry_app = typer.Typer(help="Bundles registered in MLflow: versions, aliases, headline metrics.",
                           no_args_is_help=True)


NO_PRELOAD_HELP = ("Switch at once, without first loading the version on every worker of its base (its first "
                   "requests on each worker then wait for the download).")
PRELOAD_TIMEOUT_HELP = ("Seconds to wait for every live worker of the base to confirm (in its heartbeat) that it has "
                        "loaded the version, before the fleet switches to it.")


def _preload(no_preload: bool, timeout_s: float) -> Preload:
    from lorafleet.registry.promote import Preload

    if timeout_s <= 0:
        _fail(f"--preload-timeout {timeout_s:g}: must be more than 0 seconds (or pass --no-preload)")
    return Preload(enabled=not no_preload, timeout_s=timeout_s, progress=typer.echo)


RETAIN_HELP = ("How long the version this replaces stays served as NAME@N for clients pinned to it: 7d, 12h, 30m, "
               "90s, 0 (retire at once) or forever (default: the fleet file's gateway.retain_s, else 7 days).")
RETAIN_VERSIONS_HELP = ("At most this many former champions stay served as NAME@N (default: the fleet file's "
                        "gateway.retain_versions, else 2).")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_duration(text: str) -> float | None:
    """Seconds of `7d`, `12h`, `30m`, `90s`, `45` (seconds); None for `forever`/`none`; ValueError otherwise."""
    t = text.strip().lower()
    if t in ("forever", "none", "never"):
        return None
    unit = _UNITS.get(t[-1:])
    number = t[:-1] if unit is not None else t
    try:
        value = float(number) * (unit or 1.0)
    except ValueError:
        raise ValueError(f"{text!r} is not a duration; use e.g. 7d, 12h, 30m, 90s, 0 or forever") from None
    if value < 0:
        raise ValueError(f"{text!r}: a duration cannot be negative")
    return value


def _retention_changes(retain: str | None, retain_versions: int | None) -> dict[str, float | int | None]:
    changes: dict[str, float | int | None] = {}
    if retain is not None:
        try:
            changes["seconds"] = parse_duration(retain)
        except ValueError as exc:
            _fail(f"--retain {exc}")
    if retain_versions is not None:
        if retain_versions < 0:
            _fail(f"--retain-versions {retain_versions}: must be 0 or more")
        changes["versions"] = retain_versions
    return changes


CREDS_HELP = ("NATS credential with the control role (default: $LORAFLEET_NATS_CREDS, else "
              "LORAFLEET_HOME/creds/control.nk); TLS from $LORAFLEET_NATS_TLS_CA and the cluster's CA.")


@registry_app.command("list")
def list_cmd(name: str = typer.Argument(None, help="Only this registered model.")) -> None:
    """Registered bundles: each version with its aliases, base model and headline metrics."""
    from lorafleet.cli import echo_home
    from lorafleet.core.tasks import get_task_kind
    from lorafleet.registry import store

    echo_home()
    try:
        models = [(name, store.versions(name))] if name else store.list_models()
    except _errors() as exc:
        _fail(str(exc))
        return
    if not models:
        typer.echo(f"no registered bundles in {store.tracking_uri()}")
        return
    for model_name, infos in models:
        task = infos[-1].task if infos else "retrieval"
        columns = get_task_kind(task).metrics.table
        typer.echo(f"{model_name}  ({task})")
        typer.echo(f"  {'version':<8} {'aliases':<22} {'base':<20} " + " ".join(f"{m:>18}" for m in columns))
        for info in infos:
            metrics = " ".join(f"{(f'{v:.4f}' if (v := info.metric(m)) is not None else '-'):>18}"
                               for m in columns)
            typer.echo(f"  v{info.version:<7} {','.join(info.aliases) or '-':<22} {info.base or '-':<20} {metrics}")


def promote(
    name: str = typer.Argument(..., help="Registered model name (= the served name)."),
    version: str = typer.Option(None, "--version", "-v", help="Version (default: alias 'candidate', else newest)."),
    force: bool = typer.Option(False, "--force", help="Skip the quality gate."),
    margin: float = typer.Option(None, "--margin", help="Required relative gain of the headline metric over what "
                                 "its kind's gate compares with, e.g. 0.02 for 2 % (default: "
                                 "$LORAFLEET_PROMOTE_MARGIN, else the margin research recorded in the bundle, else "
                                 "2 %)."),
    nats_url: str = typer.Option(None, "--nats-url", help="Cluster to update (default: LORAFLEET_HOME/cluster.json)."),
    fleet: Path = typer.Option(None, "--fleet", help="Fleet YAML of that cluster (to check its base models)."),
    creds: Path = typer.Option(None, "--creds", help=CREDS_HELP),
    no_preload: bool = typer.Option(False, "--no-preload", help=NO_PRELOAD_HELP),
    preload_timeout: float = typer.Option(120.0, "--preload-timeout", help=PRELOAD_TIMEOUT_HELP + " A worker that "
                                          "does not confirm in time fails the promotion, nothing changed."),
    retain: str = typer.Option(None, "--retain", help=RETAIN_HELP),
    retain_versions: int = typer.Option(None, "--retain-versions", help=RETAIN_VERSIONS_HELP),
    canary: float = typer.Option(None, "--canary", help="Send only this percent (0 < P < 100) of the name's traffic "
                                 "to the version, sticky per client (X-Lorafleet-Route-Key, else the API key, else "
                                 "the address); the rest stays on the champion. End it with --finish or --abort."),
    shadow: float = typer.Option(None, "--shadow", help="Generative and rerank models: copy this percent "
                                 "(0 < P < 100) of the name's requests to the version after the champion answered; "
                                 "clients only ever get the champion's answer, the copy's is compared (latency, "
                                 "length, agreement) and discarded. End it with --finish or --abort, which log the "
                                 "figures to the version's MLflow run (online_* metrics)."),
    finish: bool = typer.Option(False, "--finish", help="End the canary or shadow in progress: its version becomes "
                                "champion (gate, preload and retention as for a promote)."),
    abort: bool = typer.Option(False, "--abort", help="End the canary or shadow in progress: all traffic back on the "
                               "champion, which stays as it is."),
    watch: str = typer.Option(None, "--watch", help="With --canary (or alone, for the canary in progress): compare "
                              "candidate and champion over all gateways for this long (e.g. 10m, 1h); abort at once "
                              "if the candidate is worse by the margins, finish when the window passes. If this "
                              "command dies, the canary stays as it is."),
    max_error_increase: float = typer.Option(1.0, "--max-error-increase", help="--watch: abort when the "
                                             "candidate's error rate (5xx) exceeds the champion's by more than this "
                                             "many percentage points."),
    max_p99_ratio: float = typer.Option(1.5, "--max-p99-ratio", help="--watch: abort when the candidate's p99 "
                                        "latency exceeds the champion's times this."),
    min_requests: int = typer.Option(20, "--min-requests", help="--watch: requests each side needs before the "
                                     "comparison counts."),
    max_empty_increase: float = typer.Option(5.0, "--max-empty-increase", help="--watch, generative models: abort "
                                             "when the candidate's share of empty answers (no text, stopped or cut "
                                             "at max_tokens) exceeds the champion's by more than this many "
                                             "percentage points."),
) -> None:
    """Quality gate → preload on the base's workers → alias 'champion' → live fleet state: gateways and workers
    switch without a restart, and the first requests to the new version do not wait for a download. With
    --canary P only P % of the traffic goes to the version until --finish (or --abort)."""
    from lorafleet.cli import echo_home
    from lorafleet.registry.promote import promote as do_promote

    echo_home()
    chosen = [f for f, on in (("--canary", canary is not None), ("--shadow", shadow is not None),
                              ("--finish", finish), ("--abort", abort)) if on]
    if len(chosen) > 1:
        _fail(f"{' and '.join(chosen)} do not go together: start a canary or a shadow, or end the one in progress")
    if shadow is not None:
        if watch is not None:
            _fail("--watch judges a canary; a shadow is compared until --finish or --abort, which log its figures")
        from lorafleet.cli.shadow import shadow_start

        shadow_start(name, version, shadow, force=force, margin=margin, nats_url=nats_url, fleet=fleet, creds=creds,
                     preload=_preload(no_preload, preload_timeout))
        return
    if (finish or abort) and version is not None:
        _fail(f"{chosen[0]} ends the canary in progress, whose version is already chosen: leave out --version")
    if watch is not None and (finish or abort):
        _fail(f"--watch and {chosen[0]} do not go together: --watch ends the canary itself")
    preload = _preload(no_preload, preload_timeout)
    changes = _retention_changes(retain, retain_versions)
    from lorafleet.cli.shadow import shadow_end

    if (finish or abort) and shadow_end(name, finish, force=force, margin=margin, nats_url=nats_url, fleet=fleet,
                                        creds=creds, preload=preload, changes=changes):
        return
    if watch is not None:
        from lorafleet.registry.watch import Margins

        try:
            window = parse_duration(watch)
            margins = Margins(max_error_increase / 100.0, max_p99_ratio, min_requests, max_empty_increase / 100.0)
        except (ValueError, *_errors()) as exc:
            _fail(f"--watch: {exc}" if isinstance(exc, ValueError) else str(exc))
            return
        if not window:
            _fail(f"--watch {watch}: the window must be a finite duration above 0 (e.g. 10m)")
    if canary is not None or abort:
        _canary(name, version, canary, force=force, margin=margin, nats_url=nats_url, fleet=fleet, creds=creds,
                preload=preload)
        if watch is None:
            return
    if watch is not None:
        _watch(name, window, margins, force=force, margin=margin, nats_url=nats_url, fleet=fleet, creds=creds,
               preload=preload, changes=changes)
        return
    try:
        if finish:
            from lorafleet.registry.canary import finish as do_finish

            out = do_finish(name, force=force, margin=margin, nats_url=nats_url, fleet_file=fleet, creds=creds,
                            preload=preload, retention_changes=changes)
        else:
            out = do_promote(name, version, force=force, margin=margin, nats_url=nats_url, fleet_file=fleet,
                             creds=creds, preload=preload, retention_changes=changes)
    except _errors() as exc:
        _fail(str(exc))
        return
    _said_repaired(out.repaired)
    gate = out.gate
    if gate is not None and gate.ok:
        vs_champ = f", champion {gate.champion_score:.4f}" if gate.champion_score is not None else ""
        rivals = "".join(f", {p} {v:.4f}" for p, v in gate.rivals.items())
        typer.echo(f"gate passed: {gate.metric} {gate.score:.4f} ({gate.against} {gate.base_score:.4f}{rivals}, "
                   f"relative margin {gate.margin:.1%}"
                   f"{f' ({gate.margin_source})' if gate.margin_source else ''}{vs_champ})")
    elif gate is not None:
        typer.secho("gate FAILED but --force given: " + "; ".join(gate.reasons), fg=typer.colors.YELLOW)
    was = f" (was v{out.previous})" if out.previous and out.previous != out.version else ""
    typer.echo(f"{name}: champion → v{out.version}{was}; fleet state published to {out.nats_url} "
               f"(adapter {out.entry.adapter_id}, base {out.entry.base})")
    for line in client_notes(out.entry, out.previous):
        typer.echo(line)
    _said_precision(out.precision)


def _canary(name: str, version: str | None, percent: float | None, *, force: bool, margin: float | None,
            nats_url: str | None, fleet: Path | None, creds: Path | None, preload: Preload) -> None:
    """`promote --canary P` (percent given) or `promote --abort` (None)."""
    from lorafleet.registry import canary

    try:
        if percent is None:
            out = canary.abort(name, nats_url=nats_url, fleet_file=fleet, creds=creds)
        else:
            out = canary.start(name, version, percent, force=force, margin=margin, nats_url=nats_url,
                               fleet_file=fleet, creds=creds, preload=preload)
    except _errors() as exc:
        _fail(str(exc))
        return
    if out.canary is None:
        typer.echo(f"{name}: canary of v{out.aborted} aborted; all traffic on the champion v{out.champion} "
                   f"(published to {out.nats_url})")
        return
    if out.gate is not None and not out.gate.ok:
        typer.secho("gate FAILED but --force given: " + "; ".join(out.gate.reasons), fg=typer.colors.YELLOW)
    typer.echo(f"{name}: canary v{out.canary} takes {out.percent:g} % of the traffic, champion v{out.champion} the "
               f"rest (sticky per client; published to {out.nats_url}). Both answer as {name}@N; end it with "
               f"`lorafleet promote {name} --finish` or `--abort`")


def _watch(name: str, window: float, margins: Any, *, force: bool, margin: float | None, nats_url: str | None,
           fleet: Path | None, creds: Path | None, preload: Preload, changes: dict[str, float | int | None]) -> None:
    """`promote --watch`: exit 0 when the canary finished, 1 when it was aborted or left as it is."""
    from lorafleet.registry.watch import watch

    try:
        out = watch(name, window, margins, nats_url=nats_url, fleet_file=fleet, creds=creds, force=force,
                    margin=margin, preload=preload, retention_changes=changes, say=typer.echo)
    except _errors() as exc:
        _fail(str(exc))
        return
    if out.result == "finished" and out.finished is not None:
        typer.echo(f"{name}: watch passed ({out.reason}); champion → v{out.finished.version} (was "
                   f"v{out.finished.previous})")
        return
    if out.result == "aborted":
        typer.secho(f"{name}: canary ABORTED, all traffic back on the champion: {out.reason}", fg=typer.colors.RED)
    else:
        typer.secho(f"{name}: {out.reason}", fg=typer.colors.YELLOW)
    raise typer.Exit(1)


def rollback(
    name: str = typer.Argument(..., help="Registered model name (= the served name)."),
    nats_url: str = typer.Option(None, "--nats-url", help="Cluster to update (default: LORAFLEET_HOME/cluster.json)."),
    fleet: Path = typer.Option(None, "--fleet", help="Fleet YAML of that cluster (to check its base models)."),
    creds: Path = typer.Option(None, "--creds", help=CREDS_HELP),
    no_preload: bool = typer.Option(False, "--no-preload", help=NO_PRELOAD_HELP),
    preload_timeout: float = typer.Option(120.0, "--preload-timeout", help=PRELOAD_TIMEOUT_HELP + " A rollback "
                                          "goes ahead after it, naming the workers that did not confirm."),
    retain: str = typer.Option(None, "--retain", help=RETAIN_HELP),
    retain_versions: int = typer.Option(None, "--retain-versions", help=RETAIN_VERSIONS_HELP),
) -> None:
    """Move 'champion' back to the previous champion version, live (preloaded on the base's workers first)."""
    from lorafleet.registry.promote import rollback as do_rollback

    preload = _preload(no_preload, preload_timeout)
    changes = _retention_changes(retain, retain_versions)
    try:
        out = do_rollback(name, nats_url=nats_url, fleet_file=fleet, creds=creds, preload=preload,
                          retention_changes=changes)
    except _errors() as exc:
        _fail(str(exc))
        return
    _said_repaired(out.repaired)
    typer.echo(f"{name}: champion → v{out.version} (rolled back from v{out.previous}); fleet state published to "
               f"{out.nats_url}")
    for line in client_notes(out.entry, out.previous):
        typer.echo(line)
    _said_precision(out.precision)


def _said_precision(notice: PrecisionNotice | None) -> None:
    """The bundle's tuned precision against what its base's workers serve (issue 27): a notice, never an error."""
    for line in notice.lines if notice is not None else ():
        typer.secho(line, fg=None if notice is not None and notice.as_tuned else typer.colors.YELLOW)


def _said_repaired(found: Agreement | None) -> None:
    if found is not None:
        typer.secho(f"repaired first: the registry and the fleet disagreed ({found.describe()}), an earlier promote "
                    "or rollback stopped half-way; the fleet state followed the champion alias",
                    fg=typer.colors.YELLOW)


@registry_app.command("check")
def check_cmd(
    name: str = typer.Argument(..., help="Registered model name (= the served name)."),
    repair: bool = typer.Option(False, "--repair", help="Make the fleet state and the champion history follow "
                                "the champion alias when they disagree (under the name's promote lock); when the "
                                "alias names a version the fleet took out (an aborted canary), the alias follows "
                                "the fleet instead."),
    nats_url: str = typer.Option(None, "--nats-url", help="Cluster to check (default: LORAFLEET_HOME/cluster.json)."),
    fleet: Path = typer.Option(None, "--fleet", help="Fleet YAML of that cluster."),
    creds: Path = typer.Option(None, "--creds", help=CREDS_HELP),
) -> None:
    """Whether the champion alias, its history and what the fleet serves agree (a promote or rollback that died
    half-way leaves them apart); exit code 1 when they disagree and --repair was not given."""
    from lorafleet.registry.promote import check
    from lorafleet.registry.shadow import drop_stale

    try:
        state = check(name, nats_url=nats_url, fleet_file=fleet, creds=creds, repair=repair)
        # a canary or shadow whose candidate is no longer consistent is dropped, never left (issue 25)
        stale = drop_stale(name, repair=repair, nats_url=nats_url, fleet_file=fleet, creds=creds)
    except _errors() as exc:
        _fail(str(exc))
        return
    if stale is not None and repair:
        typer.echo(f"{name}: dropped the canary/shadow: {stale}; all traffic on the champion")
    elif stale is not None:
        _fail(f"{name}: {stale}; run with --repair to drop it")
    if state.repaired:
        typer.echo(f"{name}: repaired; now {state.describe()}")
    elif state.agrees:
        typer.echo(f"{name}: agrees ({state.describe()})")
    else:
        _fail(f"{name}: the registry and the fleet disagree ({state.describe()}); run with --repair")


UI_VIEW_PREFIX = "mlflow.sharedViewState.lorafleet"  # the saved runs views research and train keep
UI_MODE = "workflowType=machine_learning"  # MLflow 3's "Model training" side of the UI, not the GenAI one


def ui_links(base_url: str, uri: str) -> list[tuple[str, str]]:
    """(what, URL) for each lorafleet experiment's runs view (its saved `lorafleet…` view when it has one)
    and each registered model, oldest experiment first; none when the store cannot be read."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    links: list[tuple[str, str]] = []
    try:
        experiments = client.search_experiments(filter_string="name LIKE 'lorafleet-%'")
        models = client.search_registered_models()
    except Exception:  # a store that does not answer: the server will say why
        return links
    for exp in sorted(experiments, key=lambda e: int(e.experiment_id) if e.experiment_id.isdigit() else 0):
        page = f"{base_url}/#/experiments/{exp.experiment_id}/runs?{UI_MODE}"
        views = sorted(k.removeprefix("mlflow.sharedViewState.") for k in exp.tags if k.startswith(UI_VIEW_PREFIX))
        links += [(f"runs of {exp.name}" + (f" (view {v})" if len(views) > 1 else ""), f"{page}&viewStateShareKey={v}")
                  for v in views] or [(f"runs of {exp.name}", page)]
    for model in sorted(models, key=lambda m: m.name):
        aliases = ", ".join(f"{a}=v{v}" for a, v in sorted((model.aliases or {}).items()))
        links.append((f"model {model.name}" + (f" ({aliases})" if aliases else ""),
                      f"{base_url}/#/models/{model.name}?{UI_MODE}"))
    return links


def ui(
    port: int = typer.Option(5000, "--port", "-p", help="Port of the MLflow UI."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on."),
) -> None:
    """Start the MLflow UI on the lorafleet store and print the direct links to each study's runs view and
    each registered model (Ctrl-C stops it)."""
    from lorafleet.cli import echo_home
    from lorafleet.core import settings

    echo_home()
    uri = settings.mlflow_tracking_uri()
    argv = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", host,
            "--port", str(port), "--workers", "1"]
    if uri.startswith("sqlite:"):
        argv += ["--default-artifact-root", settings.mlflow_artifact_root()]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
           "DO_NOT_TRACK": "1"}
    base_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"
    typer.echo(f"MLflow UI on {base_url}/#/experiments?{UI_MODE}  (store {uri}); Ctrl-C stops it")
    for what, url in ui_links(base_url, uri):
        typer.echo(f"  {what}: {url}")
    sys.stdout.flush()
    # Own process group: Ctrl-C here stops the server and every worker it forked, nothing else.
    proc = subprocess.Popen(argv, env=env, start_new_session=True)

    def _stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # SIGINT too: a command started in the background of a script inherits SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler of its own.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        from lorafleet.ops.cluster import stop_group

        stop_group(proc.pid, 10.0, "mlflow")
        typer.echo("MLflow UI stopped")
        return
    if code:
        _fail(f"mlflow server exited with code {code}")


def register(app: typer.Typer) -> None:
    app.add_typer(registry_app, name="registry")
    app.command("promote")(promote)
    app.command("rollback")(rollback)
    app.command("ui")(ui)
