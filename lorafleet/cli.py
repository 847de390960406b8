"""The `lorafleet` command. Thin: each command parses its arguments and calls one stage's API.

Stages register their commands here; heavy imports (torch, mlflow) stay inside the commands so
that `lorafleet --help` answers at once.
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


def _register() -> None:
    # Each stage owns its commands (in <stage>/cli.py) and adds them to `app` here.
    from lorafleet.serve import cli as serve_cli

    serve_cli.register(app)
    from lorafleet.train import cli as train_cli

    train_cli.register(app)
    from lorafleet.research import cli as research_cli

    research_cli.register(app)
    from lorafleet.tune import cli as tune_cli

    tune_cli.register(app)
    from lorafleet.registry import cli as registry_cli

    registry_cli.register(app)


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
