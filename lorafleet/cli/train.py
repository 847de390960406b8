"""`lorafleet train CONFIG`: one training run without search."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train(
        config: Path = typer.Argument(..., help="YAML file with a top-level 'train:' section."),
        set_: list[str] = typer.Option(
            [], "--set", help="Override a setting of the train section, e.g. --set epochs=2 --set lora.r=16."
        ),
        out: Path | None = typer.Option(None, "--out", help="Output folder (default LORAFLEET_HOME/runs/train-…)."),
        no_mlflow: bool = typer.Option(False, "--no-mlflow", help="Do not log an MLflow run."),
        run_name: str | None = typer.Option(None, "--run-name", help="MLflow run name."),
    ) -> None:
        """Train one LoRA adapter: build the dataset, score the base model and the baseline, train, evaluate, report."""
        import os

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from lorafleet.core.config import ConfigError, apply_overrides, read_yaml
        from lorafleet.core.metrics import to_test
        from lorafleet.core.plugins import PluginError
        from lorafleet.core.settings import DataDirError
        from lorafleet.core.tasks import get_task_kind

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                            stream=sys.stderr)
        try:
            raw = read_yaml(config)
            if not isinstance(raw, dict) or "train" not in raw:
                raise ConfigError(f"{config} has no top-level 'train:' section")
            kind = get_task_kind(raw.get("task") or "retrieval")
            section = apply_overrides(dict(raw["train"] or {}), list(set_))
            cfg = kind.parse_config(section, source=f"{config} [train]")
            result = kind.run(cfg, out, log_mlflow=not no_mlflow, run_name=run_name)
        except (ConfigError, DataDirError, PluginError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        m = result.metrics
        spec = kind.metrics
        typer.echo(f"adapter: {result.adapter_dir}")
        typer.echo(f"report:  {result.report_path}")
        for key in (spec.objective, to_test(spec.objective)):
            split = key.split("_", 1)[0]
            other = ""
            if spec.baseline:
                other = f"{spec.baseline_label} {m.get(f'{spec.baseline}_{key}', float('nan')):.4f}  "
            base = m.get(f"base_{key}", float("nan"))
            lift = (m[key] - base) / abs(base) * 100 if base else float("nan")
            typer.echo(f"{split} {spec.label or key}: {other}base {base:.4f}  lora {m[key]:.4f}  ({lift:+.1f} %)")
        c = result.cost
        typer.echo(f"cost: wall {c['wall_s']:.0f} s, cpu {c['cpu_s']:.0f} s, peak RSS {c['peak_rss_mb']:.0f} MB, "
                   f"${c['usd']:.4f}")
