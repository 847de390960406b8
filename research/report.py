"""Human-facing output of a research run: PNG plots, the markdown report, the terminal table."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from lorafleet.core.tasks import MetricSpec, get_task_kind

if TYPE_CHECKING:
    from .result import ResearchResult


def save_plots(study: optuna.Study, out: Path) -> list[Path]:
    """Optimisation history and parameter importances (importances need two or more complete trials)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in tests
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    written = []
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    plots = [("optimization_history.png", ovm.plot_optimization_history)]
    if len(complete) >= 2:
        plots.append(("param_importances.png", ovm.plot_param_importances))
    for name, fn in plots:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ax = fn(study)
            fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            fig.set_size_inches(8, 5)
            fig.tight_layout()
            fig.savefig(out / name, dpi=100)
            plt.close(fig)
            written.append(out / name)
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:  # e.g. no variance to attribute
            (out / (name + ".txt")).write_text(f"not drawn: {exc}\n")
    return written


def _spec(result: ResearchResult) -> MetricSpec:
    return get_task_kind(result.task).metrics


def _references(spec: MetricSpec) -> list[tuple[str, str]]:
    """(prefix, column) of what the winner is compared with: the base model, the kind's baseline, the gate's best
    baseline (where it is another) and each rival."""
    refs = [("base", "base model")] + ([(spec.baseline, spec.baseline_label)] if spec.baseline else [])
    if spec.gate not in {p for p, _ in refs}:
        refs.append((spec.gate, "best baseline (gate)"))
    return refs + [(r.prefix, r.column) for r in spec.rivals]


def columns(result: ResearchResult) -> list[str]:
    return ["metric", *(col for _, col in _references(_spec(result))), "winner", "winner, seed 2"]


def comparison_rows(result: ResearchResult) -> list[tuple[str, list[float | None]]]:
    """Rows (metric, [base, the non-learned baseline, the gate's and rivals' where the kind has them, winner,
    winner seed 2]) for dev and test."""
    spec = _spec(result)
    names = spec.report or (spec.objective.removeprefix("dev_"),)
    rows = []
    for split in ("dev", "test"):
        for m in names:
            key = f"{split}_{m}"
            vals = [result.baseline.get(f"{p}_{key}") for p, _ in _references(spec)]
            vals += [result.winner_metrics.get(key), result.reseed_metrics.get(key)]
            if any(v is not None for v in vals):
                rows.append((key, vals))
    return rows


def gate_lines(result: ResearchResult) -> list[str]:
    """What the verdict compared, in words: the headline on dev and test against each of the kind's gates, by
    the margin, on the winner's own configuration's data; then the kind's notes on how numbers are measured."""
    spec = _spec(result)
    margin = "the margin" if result.margin is None else f"a relative margin of {result.margin:.1%}"
    against = " and ".join(label for _, label in spec.gates)
    lines = [f"- gate: `{result.objective}` on dev and the winner's worst test `{spec.headline}` over its seeds "
             f"must beat {against} by {margin}, strictly (a tie is no win); the baselines are those of the "
             "winner's own configuration, scored on its dataset"
             + (f" `{result.dataset_digest[:12]}`" if result.dataset_digest else "")]
    lines += [f"- {note}" for note in spec.notes]
    return lines


def _fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.4f}"


def render_markdown(result: ResearchResult, trials: list[dict[str, Any]], research_cfg: dict[str, Any],
                    plots: list[str]) -> str:
    lines = [f"# Research run `{result.study}`", "", f"**Verdict:** {result.verdict}", ""]
    lines += [f"- objective: `{result.objective}` (chosen on dev; test only for the winner and the baseline)",
              f"- MLflow parent run: `{result.parent_run_id}`", f"- Optuna storage: `{result.storage}`",
              f"- trials: {json.dumps(result.trials)}", *gate_lines(result), ""]
    if result.winner_trial is not None:
        lines += [f"## Winner: trial #{result.winner_trial}", "", "```json",
                  json.dumps(result.winner_params, indent=2, default=str), "```", "",
                  f"adapter: `{result.winner_adapter_dir}`", ""]
        if result.spread:
            lines += ["Seed spread (|seed 1 − seed 2|): " +
                      ", ".join(f"{k} {v:.4f}" for k, v in result.spread.items()), ""]
    header = columns(result)
    lines += ["## Baseline vs winner", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [f"| {k} | " + " | ".join(_fmt(v) for v in vals) + " |" for k, vals in comparison_rows(result)]
    lines += ["", "## Trials", "", "| # | state | objective | epochs run | wall s | params | note |",
              "|---|---|---|---|---|---|---|"]
    for t in trials:
        params = ", ".join(f"{k}={v}" for k, v in t["params"].items())
        note = t.get("reason") or (f"retry of #{t['retry_of']}" if t.get("retry_of") is not None else "")
        wall = "" if t.get("wall_s") is None else f"{t['wall_s']:.0f}"
        lines.append(f"| {t['number']} | {t['state']} | {_fmt(t['value'])} | {t['epochs_run']} | {wall} | "
                     f"{params} | {str(note).replace('|', '/')[:120]} |")
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += ["", "## Research config", "", "```json", json.dumps(research_cfg, indent=2, default=str), "```", ""]
    return "\n".join(lines)


def print_summary(result: ResearchResult) -> None:
    """The end-of-run table, the MLflow run id, and how to look at it."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not result.finalized:
        if result.verdict:  # summarised earlier (e.g. `resume` of a finished study)
            console.print(f"trials: {result.trials}; summarised earlier: {result.verdict}")
        else:
            console.print(f"trials so far: {result.trials}; this process did not write the study's summary "
                          "(another process driving it does, or `lorafleet research resume` when all are done)")
        console.print(f"MLflow parent run: {result.parent_run_id} (experiment lorafleet-research/{result.study})")
        console.print("look at it: lorafleet ui")
        return
    table = Table(title=f"research {result.study}: baseline vs winner")
    for col in columns(result):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for key, vals in comparison_rows(result):
        table.add_row(key, *(_fmt(v) for v in vals))
    console.print(table)
    for line in gate_lines(result):
        console.print(line)
    console.print(f"trials: {result.trials}")
    if result.winner_trial is not None:
        console.print(f"winner: trial #{result.winner_trial} {result.winner_params}")
        console.print(f"adapter: {result.winner_adapter_dir}")
    if result.spread:
        console.print("seed spread: " + ", ".join(f"{k} {v:.4f}" for k, v in result.spread.items()))
    console.print(result.verdict or "summary not written by this process")
    console.print(f"MLflow parent run: {result.parent_run_id} (experiment lorafleet-research/{result.study})")
    if result.report_path:
        console.print(f"report: {result.report_path}")
    console.print("look at it: lorafleet ui   (MLflow UI on the local store)")
