"""The `lorafleet` command: the top layer. Thin: each command parses its arguments and calls the
pipeline's or one stage's public API, and turns their errors into a message and an exit code.

Commands live in one module per area (serve, train, research, tune, registry); heavy imports
(torch, mlflow) stay inside the commands so that `lorafleet --help` answers at once.
"""

from __future__ import annotations

import typer

from lorafleet import __version__

app = typer.Typer(
    name="lorafleet",
    help="Train, tune, register and serve fleets of small LoRA specialists from one pull-based queue.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lorafleet {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """lorafleet: ship small specialists, serve many of them from one queue."""


def echo_home() -> None:
    """Say on stderr which home a command uses when it is not the default (LORAFLEET_HOME, an old ./.lorafleet)."""
    from lorafleet.core import settings

    settings.home()  # links an old ./.lorafleet first (and says so), after which it is the default
    line = settings.home_line()
    if line:
        typer.echo(line, err=True)


def _register() -> None:
    from lorafleet.cli import creds, data, registry, research, runtime, serve, train, tune

    for module in (serve, creds, data, runtime, train, research, tune, registry):
        module.register(app)


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
