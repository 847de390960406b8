"""What promote, rollback, canary and shadow commands share: the client notes they print and the errors they
turn into an exit code. Its own module so that `cli/registry.py` and `cli/shadow.py` both import it and not
each other."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from lorafleet.core.fleet_state import FleetEntry


def _when(t: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


def client_notes(entry: FleetEntry, previous: str | None) -> list[str]:
    """What changed for clients of `entry.name` (printed by promote and rollback): the version the plain name
    answers with now, which former versions stay served as NAME@N and until when, how to re-index."""
    name = entry.name
    lines = [f"clients: {name} now answers with v{entry.version} (responses name {name}@{entry.version}); "
             f"pin it as {name}@{entry.version}"]
    for kept in entry.retained:
        until = f"until {_when(kept.until)}" if kept.until is not None else "with no time limit"
        lines.append(f"  {name}@{kept.version} is still served {until}, or until newer versions replace it")
    if previous is not None and previous != entry.version:
        if all(k.version != previous for k in entry.retained):
            lines.append(f"  {name}@{previous} is retired now: pinned requests for it get 410 version_retired")
        if entry.kind != "causal-lm":  # vectors of different versions live in different spaces
            lines.append(f"  re-index: embed your corpus with model {name}@{entry.version}, switch your index to "
                         f"it, then stop using {name}@{previous} (docs/ship.md, 'Re-indexing after a promote')")
    return lines


def _fail(message: str, code: int = 1) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


def _errors() -> tuple[type[BaseException], ...]:
    from lorafleet.core.config import ConfigError
    from lorafleet.core.fleet_state import FleetStateError
    from lorafleet.core.plugins import PluginError
    from lorafleet.registry.bundle import BundleError
    from lorafleet.registry.promote import PromotionError
    from lorafleet.registry.store import RegistryError

    return (RegistryError, BundleError, PromotionError, FleetStateError, ConfigError, PluginError)
