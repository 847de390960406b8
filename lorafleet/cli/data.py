"""`lorafleet data fetch` / `data info`: the statutes that training reads, from their public source."""

from __future__ import annotations

from pathlib import Path

import typer

data_app = typer.Typer(help="The datasets training reads: fetch the statutes, see where data is found.",
                       no_args_is_help=True)


@data_app.command("fetch")
def fetch(
    source: str = typer.Option(None, "--source", "-s", envvar="LORAFLEET_DATA_SOURCE", help="Where from: a URL "
                               "(default: the bundestag/gesetze archive on GitHub), a local git clone or folder in "
                               "its <letter>/<law>/index.md layout, or a .tar.gz/.zip archive file."),
    dest: Path = typer.Option(None, "--dest", help="Data folder to fill (default: $LORAFLEET_DATA_DIR if set, "
                              "else LORAFLEET_HOME/data)."),
    if_missing: bool = typer.Option(False, "--if-missing", help="Do nothing when training already finds statutes "
                                    "(no download; what scripts/setup.sh runs)."),
) -> None:
    """Get the German federal statutes, verify them, and store them where training finds them."""
    from lorafleet.cli import echo_home
    from lorafleet.core.settings import DataDirError, find_statutes
    from lorafleet.train.statute_source import fetch_statutes

    echo_home()
    found = None
    if if_missing:
        found = find_statutes() if dest is None else (dest if (dest / "gesetze").is_dir() else None)
    if found is not None:
        typer.echo(f"statutes already in {found / 'gesetze'}; nothing fetched")
        return
    try:
        result = fetch_statutes(source, dest, say=lambda t: typer.echo(t, err=True))
    except DataDirError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1) from None
    record = result.record
    typer.echo(f"{result.laws} laws in {result.dest / 'gesetze'} ({'updated' if result.changed else 'unchanged'}); "
               f"source {record.get('source')}, commit {record.get('commit') or '-'}, "
               f"sha256 {record.get('sha256') or '-'}")


@data_app.command("info")
def info() -> None:
    """Where training finds the statutes, and where they came from."""
    from lorafleet.cli import echo_home
    from lorafleet.core.settings import DataDirError, data_dir
    from lorafleet.train.statute_source import source_record

    echo_home()
    try:
        root = data_dir()
    except DataDirError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1) from None
    laws = sorted(p.stem for p in (root / "gesetze").glob("*.md"))
    record = source_record(root) or {}
    typer.echo(f"data folder: {root}")
    typer.echo(f"laws: {len(laws)} ({', '.join(laws[:12])}{', …' if len(laws) > 12 else ''})")
    typer.echo(f"source: {record.get('source', 'unrecorded (filled by hand)')}; commit {record.get('commit') or '-'}")


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
