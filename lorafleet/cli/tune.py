"""CLI of the serving-profile sweep: `lorafleet tune`."""

from __future__ import annotations

from pathlib import Path

import typer


def tune(
    source: str = typer.Argument(..., help="Adapter folder, bundle folder, MLflow run id, or NAME@alias / NAME/N."),
    slo_p99_ms: float = typer.Option(250.0, "--slo-p99-ms", help="Latency SLO: p99 in ms at the offered load."),
    slo_ttft_p99_ms: float = typer.Option(2000.0, "--slo-ttft-p99-ms", help="Generative specialists (a causal-LM "
                                          "LoRA): SLO on time to first token, p99 in ms; their engine options are "
                                          "swept instead of the batching profile."),
    memory_gb: float = typer.Option(None, "--memory-gb", help="Limit on the worker's peak memory (GiB)."),
    quick: bool = typer.Option(False, "--quick", help="Three profiles, short load points (well under a minute)."),
    base: str = typer.Option(None, "--base", help="Base model, if the adapter's recorded one is not on this machine."),
    out: Path = typer.Option(None, "--out", "-o", help="Output folder (default: LORAFLEET_HOME/tune/<label>-<time>)."),
    budget_s: float = typer.Option(None, "--budget-s", help="Stop starting new profiles after this many seconds."),
) -> None:
    """Sweep the serving profile on a private local cluster; write profile.yaml, results and a plot."""
    from lorafleet import pipeline
    from lorafleet.core.config import ConfigError
    from lorafleet.registry.bundle import BundleError
    from lorafleet.registry.store import RegistryError
    from lorafleet.tune.config import TuneConfig, TuneError

    overrides: dict[str, object] = {"slo_p99_ms": slo_p99_ms, "memory_gb": memory_gb,
                                    "slo_ttft_p99_ms": slo_ttft_p99_ms}
    if budget_s is not None:
        overrides["budget_s"] = budget_s
    try:
        cfg = TuneConfig.quick_preset(**overrides) if quick else TuneConfig(**overrides)
        result = pipeline.tune(source, cfg, out_dir=out, base=base, say=lambda t: typer.echo(t, err=True))
    except (TuneError, RegistryError, BundleError, ConfigError, ValueError) as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1) from None
    if hasattr(result, "options"):  # a generative specialist: the engine options of its base
        best = result.recommended
        typer.echo(f"recommended engine options for the base ({'meets' if result.meets_slo else 'does NOT meet'} the "
                   "TTFT objective; put them under bases[].options):")
        for k, v in result.options.items():
            typer.echo(f"  {k}: {v}")
        typer.echo(f"  → {best.tokens_per_s:.1f} output tok/s, TTFT p50 {best.ttft_p50_ms} / p99 "
                   f"{best.ttft_p99_ms} ms, ITL p50 {best.itl_p50_ms} ms "
                   f"(default: {result.baseline_tokens_per_s:.1f} tok/s)")
        for name, path in result.files.items():
            typer.echo(f"  {name:<8} {path}")
        return
    rec = result.recommendation
    typer.echo(f"recommended profile ({'meets the SLO' if rec.meets_slo else 'does NOT meet the SLO'}):")
    for k, v in result.profile.model_dump().items():
        typer.echo(f"  {k}: {v}")
    typer.echo(f"  → {rec.result.throughput_rps:.1f} req/s, p99 {rec.result.p99_ms:.0f} ms, "
               f"peak RSS {rec.result.peak_rss_mb:.0f} MB (default profile: {result.baseline_rps:.1f} req/s)")
    for name, path in result.files.items():
        typer.echo(f"  {name:<8} {path}")


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)
