"""`lorafleet research run|resume`: thin wrappers over `lorafleet.pipeline.run` / `resume`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import typer

research_app = typer.Typer(
    help="Auto-research: an Optuna study over LoRA trainings, tracked in MLflow.", no_args_is_help=True
)

_STORAGE_HELP = ("Optuna storage URL (default: sqlite under LORAFLEET_HOME/optuna, or $LORAFLEET_OPTUNA_STORAGE). "
                 "Use postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB (pip install 'lorafleet[postgres]') to drive "
                 "one study from several machines, with MLFLOW_TRACKING_URI naming one MLflow server.")


def _fail(exc: Exception) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(2)


def _check_limits(trials: int | None, budget_minutes: float | None) -> None:
    from lorafleet.core.config import ConfigError

    if budget_minutes is not None and budget_minutes <= 0:
        _fail(ConfigError(f"--budget-minutes must be positive, got {budget_minutes}"))
    if trials is not None and trials < 1:
        _fail(ConfigError(f"--trials must be at least 1, got {trials}"))


def _say(text: str) -> None:
    typer.echo(text, err=True)


@contextlib.contextmanager
def _exits(study: Callable[[], str]) -> Iterator[None]:
    """The exit codes of a research command: 2 bad config, 1 shipping failed, 130 interrupted."""
    from lorafleet import pipeline
    from lorafleet.core.config import ConfigError

    try:
        yield
    except ConfigError as exc:
        _fail(exc)
    except pipeline.ShipError as exc:  # the research result stands; only shipping failed
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    except KeyboardInterrupt:
        typer.echo(f"\ninterrupted; continue with: lorafleet research resume {study()}", err=True)
        raise typer.Exit(130) from None


@research_app.command("run")
def run_cmd(
    config: Path = typer.Argument(..., help="YAML with 'train:' and 'research:' sections; 'task:' names the task "
                                  "kind (default retrieval)."),
    trials: int | None = typer.Option(None, "--trials", help="Trials to finish in the study (overrides n_trials)."),
    budget_minutes: float | None = typer.Option(None, "--budget-minutes", help="Wall-clock budget of this run."),
    study: str | None = typer.Option(None, "--study", help="Study name (overrides research.study)."),
    storage: str | None = typer.Option(None, "--storage", help=_STORAGE_HELP),
    overrides: list[str] = typer.Option([], "--set", help="Override a config key, e.g. --set train.epochs=2."),
    worker: bool = typer.Option(False, "--worker", help="Only run trials of the study; leave baseline and summary "
                                "to the other processes."),
    plain: bool = typer.Option(False, "--plain", help="Plain progress lines even on a terminal."),
    ship: bool = typer.Option(True, "--ship/--no-ship", envvar="LORAFLEET_RESEARCH_SHIP",
                              help="Tune and register a candidate winner (alias 'candidate') at the end."),
    tune_quick: bool = typer.Option(False, "--tune-quick", help="Ship with the quick serving-profile sweep."),
) -> None:
    """Start (or join) a research study, end with the baseline-vs-winner verdict, ship a candidate winner."""
    from lorafleet import pipeline
    from lorafleet.research.config import load_config
    from lorafleet.research.report import print_summary

    _check_limits(trials, budget_minutes)
    sets = list(overrides)
    if study is not None:
        sets.append(f"research.study={study}")
    name = [study or "NAME"]
    with _exits(lambda: name[0]):
        loaded = load_config(config, sets)
        name[0] = loaded.research.study
        pipeline.run(loaded, n_trials=trials, budget_minutes=budget_minutes, storage=storage, worker_only=worker,
                     progress_live=False if plain else None, ship_winner=ship, tune_quick=tune_quick,
                     on_researched=print_summary, say=_say)


@research_app.command("resume")
def resume_cmd(
    name: str = typer.Argument(..., help="Study name to continue."),
    trials: int | None = typer.Option(None, "--trials", help="Trials to finish in the study (default: as started)."),
    budget_minutes: float | None = typer.Option(None, "--budget-minutes", help="Wall-clock budget of this run."),
    storage: str | None = typer.Option(None, "--storage", help=_STORAGE_HELP),
    plain: bool = typer.Option(False, "--plain", help="Plain progress lines even on a terminal."),
    ship: bool = typer.Option(True, "--ship/--no-ship", envvar="LORAFLEET_RESEARCH_SHIP",
                              help="Tune and register a candidate winner (alias 'candidate') at the end."),
    tune_quick: bool = typer.Option(False, "--tune-quick", help="Ship with the quick serving-profile sweep."),
) -> None:
    """Continue a study after a crash: interrupted trials are failed and their configurations retried."""
    from lorafleet import pipeline
    from lorafleet.research.report import print_summary

    _check_limits(trials, budget_minutes)
    with _exits(lambda: name):
        pipeline.resume(name, n_trials=trials, budget_minutes=budget_minutes, storage=storage,
                        progress_live=False if plain else None, ship_winner=ship, tune_quick=tune_quick,
                        on_researched=print_summary, say=_say)


def register(app: typer.Typer) -> None:
    app.add_typer(research_app, name="research")



