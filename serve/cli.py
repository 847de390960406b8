"""CLI commands of the serving side: up, down, status, embed."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    pass
