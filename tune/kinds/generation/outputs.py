"""The generation kind's files: profile.yaml (the base's engine options), results, precisions.csv, a plot."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from lorafleet.models.precision import FP32
from lorafleet.tune.config import GenerativeTuneConfig
from lorafleet.tune.kinds.generation.result import GenerativeTuneResult
from lorafleet.tune.report import machine, write_csv
from lorafleet.tune.source import TuneSource


def write_generative_outputs(result: GenerativeTuneResult, cfg: GenerativeTuneConfig, source: TuneSource
                             ) -> dict[str, Path]:
    out = result.out_dir
    files = {"profile": out / "profile.yaml", "csv": out / "results.csv", "json": out / "results.json",
             "plot": out / "tokens_ttft.png"}
    best = result.recommended
    when = time.strftime("%Y-%m-%d %H:%M")
    header = (f"# lorafleet tune (generative): {source.label} on {source.base_name}, {when}\n"
              f"# {result.reason}: {best.tokens_per_s:.1f} output tok/s, TTFT p99 {best.ttft_p99_ms} ms at "
              f"concurrency {max(cfg.concurrencies)}, {cfg.adapters} adapter id(s) in the load\n"
              "# engine options of the base: put them under bases[].options (runtime: vllm) in the fleet file;\n"
              "# max_cpu_loras is also how many adapters a worker keeps loaded on that base\n"
              f"# judged at {result.profile.precision or FP32} by the quality guard (precisions.csv), measured at it; "
              "`precision: auto` on the base serves it so\n")
    files["profile"].write_text(header + yaml.safe_dump({"runtime": "vllm", "options": result.options},
                                                        sort_keys=False))
    write_csv(files["csv"], [r.row() for r in result.results])
    files["json"].write_text(json.dumps({
        "source": {"label": source.label, "adapter_dir": str(source.adapter_dir), "base": source.base_name,
                   "base_source": source.base_source},
        "config": cfg.model_dump(mode="json"), "machine": machine(), "recommended": {
            "options": result.options, "meets_slo": result.meets_slo, "reason": result.reason, **best.row()},
        "baseline_tokens_per_s": round(result.baseline_tokens_per_s, 2),
        "profiles": [{**r.row(), "points": r.points} for r in result.results], "wall_s": round(result.wall_s, 1),
        "precision": result.profile.precision, "precisions": [q.row() for q in result.quality],
    }, indent=2))
    files["precisions"] = out / "precisions.csv"
    write_csv(files["precisions"], [q.row() for q in result.quality])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for r in result.results:
        if r.ttft_p99_ms is not None:
            ax.scatter(r.ttft_p99_ms, r.tokens_per_s, color="tab:red" if r.recommended else "tab:blue")
            loras = f" loras {r.options['max_loras']}/{r.options.get('max_cpu_loras', r.options['max_loras'])}" \
                if "max_loras" in r.options else ""
            ax.annotate(f"seqs {r.options.get('max_num_seqs')}{loras}", (r.ttft_p99_ms, r.tokens_per_s), fontsize=7)
    ax.axvline(cfg.slo_ttft_p99_ms, color="grey", linestyle="--", label="TTFT p99 objective")
    ax.set_xlabel(f"TTFT p99 (ms) at concurrency {max(cfg.concurrencies)}")
    ax.set_ylabel("output tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(files["plot"], dpi=110)
    plt.close(fig)
    return files
