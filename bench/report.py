"""Markdown tables from bench/results/*.json, for docs/benchmarks.md.

    python -m lorafleet.bench.report [serve|serve-peers|serve-security|routing|train|research ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lorafleet.bench.common import RESULTS_DIR, fmt


def _machine(r: dict[str, Any]) -> str:
    m = r["machine"]
    return (f"_{r['when']}, {m['cpus']} vCPU {m['cpu']}, load average {m['loadavg_start'][0]} at the start and "
            f"{m['loadavg_end'][0]} at the end, {r['wall_s']:.0f} s{', --quick' if r.get('quick') else ''}._")


def serve(r: dict[str, Any]) -> str:
    raw = r["raw"]["start"]
    lines = [_machine(r), "", f"Inputs: {r['inputs']['description']} (mean {r['inputs']['mean_tokens']} tokens); "
             f"torch threads {r.get('torch_threads')}.", "",
             "| raw encode batch | sentences/s | call p50 ms |", "|---:|---:|---:|"]
    for b, v in raw["by_batch"].items():
        lines.append(f"| {b} | {v['sentences_per_s']:.1f} | {v['call_p50_ms']:.1f} |")
    end = r["raw"].get("end")
    if end:
        lines.append(f"\nRaw best batch again at the end (drift): {end['best_sentences_per_s']:.1f} sentences/s.\n")
    summ = r["summary"]
    lines += ["| system | c | req/s | p50 ms | p99 ms | × raw best batch¹ | errors | load generator CPU |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in r["systems"].items():
        if "points" not in s:
            lines.append(f"| {name} | — | not measured: {s.get('error', '?')[:200]} | | | | | |")
            continue
        for p in s["points"]:
            lines.append(f"| {name} | {int(p['level'])} | {p['throughput_rps']:.1f} | {fmt(p['p50_ms'])} | "
                         f"{fmt(p['p99_ms'])} | {summ[name]['ratio_to_raw_best'][str(int(p['level']))]:.2f} | "
                         f"{p['errors']} | "
                         f"{p['gen_cpu_pct']:.1f} % |")
    lines.append("\n¹ against raw best-batch encode measured right before that system (the machine drifts).\n")
    for name, s in r["systems"].items():
        if "min_cosine" in s:
            lines.append(f"- {name}: min cosine to raw encode {s['min_cosine']:.6f}, ready in {s['startup_s']} s")
    for name in r["systems"]:
        v = summ.get(name)
        if v:
            line = (f"- {name}: raw right before it: best batch {v['raw_best_sentences_per_s']:.1f} sentences/s, "
                    f"batch-1 call p50 {fmt(v['raw_batch1_p50_ms'], 2)} ms")
            if v["c1_p50_minus_raw_batch1_ms"] is not None:
                line += f"; c=1 p50 − raw batch-1 = {v['c1_p50_minus_raw_batch1_ms']:+.2f} ms"
            if v.get("c1_p50_minus_naive_c1_ms") is not None:
                line += f"; c=1 p50 − naive c=1 p50 = {v['c1_p50_minus_naive_c1_ms']:+.2f} ms"
            lines.append(line)
    for k, t in summ["targets"].items():
        detail = {kk: vv for kk, vv in t.items() if kk not in ("met", "per_concurrency")}
        lines.append(f"- target `{k}`: **{'met' if t['met'] else 'missed'}** {detail or ''}")
        for c, v in t.get("per_concurrency", {}).items():
            lines.append(f"  - c={c}: throughput ×{v['throughput_ratio']}, p99 {v['p99_lorafleet_ms']} vs "
                         f"{v['p99_infinity_ms']} ms → {'met' if v['met'] else 'missed'}")
    return "\n".join(lines)


def routing(r: dict[str, Any]) -> str:
    st = r["setup"]
    budget = st.get("max_batch_ms")
    budget_note = (f"batch time budget (`max_batch_ms`) {budget}{' ms' if isinstance(budget, (int, float)) else ''}"
                   if budget else "no batch time budget (`max_batch_ms` off)")
    profile = {k: v for k, v in st["profile"].items() if k != "max_batch_ms"}
    lines = [_machine(r), "", f"Profile for every policy: {profile}; {budget_note}; "
             f"queue storage {st['queue_storage']}; "
             f"{st['point_s']} s of arrivals per rate; push = {st['push_algorithm']}, stale view polled every "
             f"{st['push_stale_poll_ms']:.0f} ms.", "",
             "| scenario | SLO p99 | policy | max rate within SLO (req/s) | saturation (req/s) | "
             "pull ÷ policy (rate, saturation) |", "|---|---:|---|---:|---:|---:|"]
    for name, sc in r["scenarios"].items():
        if "error" in sc:
            lines.append(f"| {name} | | failed: {sc['error'][:200]} | | | |")
            continue
        for pol, pr in sc["policies"].items():
            ratio = sc["ratios"].get(f"pull/{pol}")
            rs = f"{fmt(ratio['max_rate_within_slo'], 2)} · {fmt(ratio['saturation'], 2)}" if ratio else "—"
            lines.append(f"| {name} | {sc['slo_p99_ms']:.0f} ms | {pol} | {fmt(pr['max_rate_within_slo'])} | "
                         f"{pr['saturation_rps']:.1f} | {rs} |")
    lines.append("")
    for name, sc in r["scenarios"].items():
        if "error" not in sc:
            b = sc.get("max_batch_ms")
            lines.append(f"- {name}: {sc['description']}; nominal capacity {sc['nominal_capacity_rps']} req/s"
                         + (f"; max_batch_ms {b:g}" if b else ""))
    for k, t in r["targets"].items():
        verdict = {True: "met", False: "missed", None: "not measured"}[t["met"]]
        lines.append(f"- target `{k}`: **{verdict}** — {json.dumps(t['ratios'])}")
    return "\n".join(lines)


def train(r: dict[str, Any]) -> str:
    st = r["setup"]
    lines = [_machine(r), "", f"Data: laws {', '.join(st['laws'])}; {st['epochs']} epoch(s) or "
             f"{st['time_budget_s_per_arm']:.0f} s of training per arm; batch {st['batch_size']}, "
             f"max_seq_length {st['max_seq_length']}; LoRA "
             f"r={st['lora']['r']} α={st['lora']['alpha']} on {', '.join(st['lora']['target_modules'])} at lr "
             f"{st['lora_learning_rate']:g}; full fine-tuning at lr {st['full_learning_rate']:g}.", "",
             "| arm | trainable params | s / epoch | epochs done | peak RSS MB: loaded → training → with eval | "
             "checkpoint | "
             "test nDCG@10 |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, a in r["arms"].items():
        if "error" in a:
            lines.append(f"| {name} | failed: {a['error'][:200]} | | | | | |")
            continue
        ck = a.get("checkpoint_bytes")
        lines.append(f"| {name} | {a.get('trainable_params', 0):,} | {fmt(a.get('seconds_per_epoch'))} | "
                     f"{fmt(a.get('epochs_done'), 2)} | {a['peak_rss_before_training_mb']:.0f} → "
                     f"{fmt(a.get('peak_rss_training_mb'), 0)} → {a['peak_rss_mb']:.0f} "
                     f"| {(f'{ck / 2**20:.2f} MiB' if ck else '—')} | {a['test_ndcg@10']:.4f} |")
    lines.append("")
    for k, v in r.get("ratios", {}).items():
        lines.append(f"- {k}: {v}")
    return "\n".join(lines)


def research(r: dict[str, Any]) -> str:
    from lorafleet.bench.research import best_vs_budget

    m = r["machine"]
    lines = [f"_{r['when']}, {m['cpus']} vCPU, load average {m['loadavg_at_start'][0]:.2f} at the start and "
             f"{m['loadavg_at_end'][0]:.2f} at the end{', --quick' if r.get('quick') else ''}; trial cap "
             f"{r['trial_cap']} per arm._", "",
             "| arm | complete | pruned | epochs trained | best dev nDCG@10 | trial wall s | trial CPU s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for a in r["arms"]:
        lines.append(f"| {a['arm']} | {a['trials_complete']} | {a['trials_pruned']} | {a['epochs_trained']} | "
                     f"{fmt(a['best_dev_ndcg@10'], 4)} | {a['trial_wall_s']:.1f} | {a['trial_cpu_s']:.1f} |")
    lines += ["", f"Pruned ÷ unpruned compute: wall {fmt(r['pruned_vs_unpruned_wall'], 2)}, CPU "
              f"{fmt(r['pruned_vs_unpruned_cpu'], 2)}, epochs {fmt(r.get('pruned_vs_unpruned_epochs'), 2)}; "
              f"winner at least as good: {r['winner_at_least_as_good']}.", "",
              "Best dev nDCG@10 against trial compute spent (minutes), trial by trial:", "",
              "| trial | " + " | ".join(a["arm"] for a in r["arms"]) + " |",
              "|---:|" + "---:|" * len(r["arms"])]
    curves = [a.get("best_vs_budget") or best_vs_budget(a["trials"]) for a in r["arms"]]
    for i in range(max(len(c) for c in curves)):
        cells = [f"{c[i]['minutes']:.1f} min → {fmt(c[i]['best'], 4)}" if i < len(c) else "" for c in curves]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lorafleet.bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", default=["serve", "routing", "train", "research"])
    p.add_argument("--dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    render = {"serve": serve, "serve-peers": serve, "serve-security": serve, "routing": routing, "train": train,
              "research": research}
    for name in args.names:
        path = args.dir / f"{name}.json"
        if name not in render:
            print(f"error: no renderer for {name!r}", file=sys.stderr)
            return 2
        if not path.is_file():
            print(f"<!-- {path} missing -->\n")
            continue
        print(f"### {name}\n\n{render[name](json.loads(path.read_text()))}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
