"""Outputs of a sweep: profile.yaml, results.csv, results.json and the throughput-vs-p99 plot."""

from __future__ import annotations

import csv
import json
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from lorafleet.tune.batching import TuneResult
    from lorafleet.tune.config import TuneConfig
    from lorafleet.tune.source import TuneSource

PROFILE_FILE = "profile.yaml"
CSV_FILE = "results.csv"
JSON_FILE = "results.json"
PLOT_FILE = "throughput_p99.png"
PRECISION_FILE = "precisions.csv"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version()}
    try:
        import psutil

        info["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:
        pass
    try:
        import torch

        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        info["cuda"] = None
    return info


def write_csv(path: Path, rows: list[dict[str, Any]], empty: tuple[str, ...] = ("precision",)) -> None:
    """`rows` as a CSV table, the columns in first-seen order (`empty`: the header of no rows)."""
    fields = list(dict.fromkeys(k for row in rows for k in row)) or list(empty)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def write_outputs(result: TuneResult, cfg: TuneConfig, source: TuneSource) -> dict[str, Path]:
    out = result.out_dir
    rec = result.recommendation
    files = {"profile": out / PROFILE_FILE, "csv": out / CSV_FILE, "json": out / JSON_FILE, "plot": out / PLOT_FILE,
             "precisions": out / PRECISION_FILE}
    # The guard's verdict per precision, joined onto each measured profile (precision × batch knobs → quality).
    quality = {q.precision: q.row() for q in result.quality}
    chosen = quality.get(result.profile.precision or "fp32", {})
    loss = chosen.get("quality_loss")
    header = (f"# lorafleet tune: {source.label} on {source.base_name}, {time.strftime('%Y-%m-%d %H:%M')}\n"
              f"# {rec.reason}: {rec.result.throughput_rps:.1f} req/s, p99 {rec.result.p99_ms:.0f} ms at "
              f"{result.results[0].points[-1]['level']} req/s offered, peak RSS {rec.result.peak_rss_mb:.0f} MB\n"
              f"# precision {result.profile.precision or 'fp32'}: "
              f"{chosen.get('quality_reason', 'no quality guard ran')}"
              + (f" (nDCG@10 loss {loss:+.4%})" if loss is not None else "") + "\n")
    files["profile"].write_text(header + yaml.safe_dump(result.profile.model_dump(mode="json"), sort_keys=False))
    blank = {k: None for k in next(iter(quality.values()), {}) if k != "precision"}
    rows = [{**r.row(), **{k: v for k, v in quality.get(r.row()["precision"], blank).items() if k != "precision"}}
            for r in result.results]
    # Every precision, measured or disqualified, with its quality and reason, and its best measured throughput.
    prows = [{**q, "best_throughput_rps": max((r["throughput_rps"] for r in rows if r["precision"] == p),
                                              default=None)} for p, q in quality.items()]
    write_csv(files["precisions"], prows)
    write_csv(files["csv"], rows)
    payload = {
        "source": {"label": source.label, "adapter_dir": str(source.adapter_dir), "base": source.base_name,
                   "base_source": source.base_source},
        "config": cfg.model_dump(mode="json"),
        "machine": machine(),
        "baseline_rps": round(result.baseline_rps, 2),
        "recommended": {"profile": result.profile.model_dump(mode="json"), "meets_slo": rec.meets_slo,
                        "reason": rec.reason, **rec.result.row(), "quality": chosen or None},
        "precisions": prows,
        "front": [r.row() for r in result.front],
        "profiles": [{**row, "points": r.points} for row, r in zip(rows, result.results, strict=True)],
        "wall_s": round(result.wall_s, 1),
    }
    files["json"].write_text(json.dumps(payload, indent=2))
    plot(result, cfg, files["plot"])
    return files


def plot(result: TuneResult, cfg: TuneConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    pts = [r for r in result.results if r.p99_ms is not None]
    ax.scatter([r.p99_ms for r in pts], [r.throughput_rps for r in pts], c="#999999", label="profiles", zorder=2)
    for r in pts:
        p = r.profile
        ax.annotate(f"{p.max_batch_items}/{p.max_batch_tokens}/{p.max_wait_ms:g}/{p.batches_in_flight}",
                    (r.p99_ms, r.throughput_rps), fontsize=7, xytext=(4, 3), textcoords="offset points")
    front = sorted(result.front, key=lambda r: r.p99_ms or 0.0)
    if front:
        ax.plot([r.p99_ms for r in front], [r.throughput_rps for r in front], "-o", color="#1f77b4",
                label="Pareto front", zorder=3)
    rec = result.recommendation.result
    if rec.p99_ms is not None:
        ax.scatter([rec.p99_ms], [rec.throughput_rps], marker="*", s=260, color="#d62728", zorder=4,
                   label="recommended")
    ax.axvline(cfg.slo_p99_ms, color="#d62728", linestyle="--", linewidth=1, label=f"SLO p99 {cfg.slo_p99_ms:g} ms")
    rate = result.results[0].points[-1]["level"] if result.results and result.results[0].points else "?"
    ax.set_xlabel(f"p99 latency (ms), open loop at {rate} req/s offered")
    ax.set_ylabel("throughput (req/s), best closed loop")
    ax.set_title("serving profiles: items/tokens/wait ms/in flight")
    ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
