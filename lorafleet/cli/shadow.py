"""`lorafleet promote NAME --shadow P`, and `--finish`/`--abort` of a shadow (issue 25, part 5): the CLI side of
registry/shadow.py, apart from lorafleet/cli/registry.py to keep that module small."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from lorafleet.cli.promotion import _errors, _fail, client_notes

if TYPE_CHECKING:
    from lorafleet.registry.promote import Preload


def shadow_start(name: str, version: str | None, percent: float, *, force: bool, margin: float | None,
                 nats_url: str | None, fleet: Path | None, creds: Path | None, preload: Preload) -> None:
    from lorafleet.registry import shadow

    try:
        shadow.check_share(percent)  # a bad share needs neither the registry nor the cluster
        out = shadow.start(name, version, percent, force=force, margin=margin, nats_url=nats_url, fleet_file=fleet,
                           creds=creds, preload=preload)
    except _errors() as exc:
        _fail(str(exc))
        return
    if out.gate is not None and not out.gate.ok:
        typer.secho("gate FAILED but --force given: " + "; ".join(out.gate.reasons), fg=typer.colors.YELLOW)
    typer.echo(f"{name}: shadow v{out.shadow} gets copies of {out.percent:g} % of the requests; champion "
               f"v{out.champion} answers every client (published to {out.nats_url}). `lorafleet status` shows the "
               f"comparison; end it with `lorafleet promote {name} --finish` or `--abort`")


def shadow_end(name: str, finish: bool, *, force: bool, margin: float | None, nats_url: str | None,
               fleet: Path | None, creds: Path | None, preload: Preload, changes: dict[str, float | int | None]
               ) -> bool:
    """`--finish`/`--abort` of a shadow (True: done); False when the name runs a canary instead."""
    from lorafleet.registry import shadow

    try:
        entry = shadow.running(name, nats_url=nats_url, fleet_file=fleet, creds=creds)
        if entry is None or (entry.shadow is None and entry.canary is None):
            _fail(f"{name} has no canary or shadow in progress to {'finish' if finish else 'abort'}; nothing "
                  f"changed (start one with `lorafleet promote {name} --canary P` or `--shadow P`)")
        assert entry is not None
        if entry.shadow is None:
            return False
        if finish:
            out, figures, run_id = shadow.finish(name, force=force, margin=margin, nats_url=nats_url,
                                                 fleet_file=fleet, creds=creds, preload=preload,
                                                 retention_changes=changes)
        else:
            ended = shadow.abort(name, nats_url=nats_url, fleet_file=fleet, creds=creds)
            figures, run_id = ended.figures, ended.logged_to
    except _errors() as exc:
        _fail(str(exc))
        return True
    shown = "  ".join(f"{k.removeprefix('online_')} {v:.4g}" for k, v in sorted((figures or shadow.ShadowFigures())
                                                                                .online_metrics().items()))
    typer.echo(f"{name}: shadow of v{entry.shadow.version} compared: {shown}")
    typer.echo(f"  logged to MLflow run {run_id} (online_* metrics)" if run_id else
               "  not logged to MLflow (the version has no run)")
    if finish:
        typer.echo(f"{name}: champion → v{out.version} (was v{out.previous}); fleet state published to {out.nats_url}")
        for line in client_notes(out.entry, out.previous):
            typer.echo(line)
    else:
        typer.echo(f"{name}: shadow of v{entry.shadow.version} aborted; champion v{entry.version} unchanged")
    return True
