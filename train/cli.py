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
        """Train one LoRA adapter: build the dataset, score base model and BM25, train, evaluate, report."""
        import os

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from lorafleet.config import ConfigError
        from lorafleet.settings import DataDirError
        from lorafleet.train.config import load_train_config
        from lorafleet.train.dataset import DatasetError

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                            stream=sys.stderr)
        try:
            cfg = load_train_config(config, set_)
            from lorafleet.train.run import run_train

            result = run_train(cfg, out, log_mlflow=not no_mlflow, mlflow_run_name=run_name)
        except (ConfigError, DataDirError, DatasetError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        m = result.metrics
        typer.echo(f"adapter: {result.adapter_dir}")
        typer.echo(f"report:  {result.report_path}")
        for split in ("dev", "test"):
            key = f"{split}_ndcg@10"
            typer.echo(f"{split} nDCG@10: bm25 {m['bm25_' + key]:.4f}  base {m['base_' + key]:.4f}  "
                       f"lora {m[key]:.4f}  ({100 * m[key + '_lift']:+.1f} %)")
        c = result.cost
        typer.echo(f"cost: wall {c['wall_s']:.0f} s, cpu {c['cpu_s']:.0f} s, peak RSS {c['peak_rss_mb']:.0f} MB, "
                   f"${c['usd']:.4f}")
