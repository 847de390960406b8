"""bench/serve.py's report: ratios against raw encode, the targets of issues 2, 6, 12 and 19, the table."""

from __future__ import annotations

from typing import Any

import numpy as np

from lorafleet.bench.common import fmt

# -- report -------------------------------------------------------------------------------------

def _refs(raw: dict[str, Any], sysres: dict[str, Any]) -> tuple[float, float | None]:
    """Raw best-batch sentences/s and batch-1 call p50 measured right before this system (else at the start)."""
    adj = sysres.get("raw_adjacent")
    if adj:
        return adj["best_sentences_per_s"], adj.get("batch1_p50_ms")
    return raw["best_sentences_per_s"], raw.get("batch1_p50_ms")


def summarise(raw: dict[str, Any], systems: dict[str, dict[str, Any]],
              ceiling: dict[str, float] | None = None,
              ceiling_per_cpu_s: dict[str, float] | None = None) -> dict[str, Any]:
    """Ratios against raw encode measured right before each system (the machine drifts), and the targets.
    `ceiling`: sentences/s of the sorted ceiling (encode over all sentences) per precision, for issue 27's targets."""
    out: dict[str, Any] = {"raw_best_batch": raw["best_batch"], "raw_best_sentences_per_s": raw["best_sentences_per_s"],
                           "raw_batch1_p50_ms": raw.get("batch1_p50_ms")}
    pts_of = {name: {int(p["level"]): p for p in s.get("points", [])} for name, s in systems.items()}
    naive1 = pts_of.get("naive", {}).get(1)
    for name, sysres in systems.items():
        pts = pts_of[name]
        if not pts:
            continue
        best, b1 = _refs(raw, sysres)
        p1 = pts.get(1)
        out[name] = {
            "raw_best_sentences_per_s": best, "raw_batch1_p50_ms": b1,
            "ratio_to_raw_best": {str(c): round(p["throughput_rps"] / best, 3) for c, p in pts.items()},
            "c1_p50_minus_raw_batch1_ms": (round(p1["p50_ms"] - b1, 2) if p1 and p1["p50_ms"] is not None and b1
                                           else None),
            # The naive server is one HTTP hop plus one encode: what a queue adds beyond plain HTTP.
            "c1_p50_minus_naive_c1_ms": (round(p1["p50_ms"] - naive1["p50_ms"], 2)
                                         if p1 and naive1 and name != "naive" else None),
        }
    targets: dict[str, Any] = user_path_targets(out, pts_of)
    security = security_cost(pts_of)
    if security:
        out["security"] = security
        targets["auth_tls_within_3pct_c32_and_0.5ms_c1"] = {
            k: security[k] for k in ("c32_throughput_ratio", "c1_p50_delta_ms")} | {"met": security["met"]}
    lfp = pts_of.get("lorafleet")
    if lfp:
        ratios = out["lorafleet"]["ratio_to_raw_best"]
        high = [c for c in lfp if c >= 32]
        if high:
            worst = min(ratios[str(c)] for c in high)
            targets["cluster_ge_0.8x_raw_best_at_c>=32"] = {"worst_ratio": worst, "met": worst >= 0.8}
        d = out["lorafleet"]["c1_p50_minus_raw_batch1_ms"]
        if d is not None:
            targets["c1_p50_within_3ms_of_raw_batch1"] = {"delta_ms": d, "met": d <= 3.0}
        infp = pts_of.get("infinity")
        if infp:
            per_c = {}
            for conc in sorted(set(lfp) & set(infp)):
                a, b = lfp[conc], infp[conc]
                per_c[str(conc)] = {
                    "throughput_ratio": (round(a["throughput_rps"] / b["throughput_rps"], 3)
                                         if b["throughput_rps"] else None),
                    "p99_lorafleet_ms": a["p99_ms"], "p99_infinity_ms": b["p99_ms"],
                    "met": a["throughput_rps"] >= b["throughput_rps"] and (a["p99_ms"] or 1e9) <= (b["p99_ms"] or 1e9),
                }
            targets["lorafleet_ge_infinity_at_le_p99"] = {"per_concurrency": per_c,
                                                          "met": all(v["met"] for v in per_c.values())}
    if ceiling:
        out["ceiling_sentences_per_s"] = ceiling
        for name in pts_of:
            if pts_of[name]:
                out[name]["ratio_to_ceiling"] = {p: {str(c): round(pt["throughput_rps"] / v, 3)
                                                     for c, pt in pts_of[name].items()} for p, v in ceiling.items()}
        targets.update(precision_targets(ceiling, pts_of))
    # On a shared machine each process gets a share of the cores: requests per CPU second of the whole serving path
    # (worker + gateway + nats-server, as sampled per point) against the ceiling's sentences per CPU second.
    for name, pts in pts_of.items():
        per_core = {str(c): round(p["throughput_rps"] / sum(p["cores_used"].values()), 1)
                    for c, p in pts.items() if p.get("cores_used") and sum(p["cores_used"].values()) > 0}
        if per_core:
            out[name]["rps_per_cpu_s"] = per_core
            if ceiling_per_cpu_s:
                out[name]["per_cpu_s_ratio_to_ceiling"] = {
                    p: {c: round(v / ref, 3) for c, v in per_core.items()} for p, ref in ceiling_per_cpu_s.items()}
    if ceiling_per_cpu_s:
        out["ceiling_per_cpu_s"] = ceiling_per_cpu_s
    auto_cpu = out.get("openai-base64", {}).get("rps_per_cpu_s", {}).get("32")
    fp32_cpu = out.get("openai-base64@fp32", {}).get("rps_per_cpu_s", {}).get("32")
    if auto_cpu and ceiling_per_cpu_s and ceiling_per_cpu_s.get("fp32"):
        r = round(auto_cpu / ceiling_per_cpu_s["fp32"], 3)
        targets["per_cpu_s_auto_base64_ge_2.0x_fp32_ceiling_at_c32"] = {"ratio": r, "met": r >= 2.0}
    if auto_cpu and fp32_cpu:
        r = round(auto_cpu / fp32_cpu, 3)
        targets["per_cpu_s_auto_base64_ge_1.9x_fp32_cluster_at_c32"] = {"ratio": r, "met": r >= 1.9}
    out["targets"] = targets
    return out


# Issue 27: the user's path at `precision: auto` (c=32, base64) against the fp32 sorted ceiling and the fp32 cluster;
# lorafleet at its tuned precision against infinity-emb at its best CPU setting.
PRECISION_C32 = {"ceiling": 2.0, "fp32_cluster": 1.9, "infinity": 1.5}


def _rps(pts_of: dict[str, dict[int, dict[str, Any]]], name: str, level: int = 32) -> float | None:
    p = pts_of.get(name, {}).get(level)
    return p["throughput_rps"] if p else None


def precision_targets(ceiling: dict[str, float], pts_of: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    auto, fp32 = _rps(pts_of, "openai-base64"), _rps(pts_of, "openai-base64@fp32")
    if auto is not None and ceiling.get("fp32"):
        r = round(auto / ceiling["fp32"], 3)
        need = PRECISION_C32["ceiling"]
        targets[f"auto_base64_ge_{need}x_fp32_ceiling_at_c32"] = {"ratio": r, "met": r >= need}
    old = _rps(pts_of, "openai-base64@auto:old")
    if auto is not None and old:
        targets["auto_base64_against_pre_issue27_worker_at_c32"] = {"ratio": round(auto / old, 3),
                                                                    "met": auto >= old}
    if auto is not None and fp32:
        r = round(auto / fp32, 3)
        need = PRECISION_C32["fp32_cluster"]
        targets[f"auto_base64_ge_{need}x_fp32_cluster_at_c32"] = {"ratio": r, "met": r >= need}
    infinity = {n: v for n in pts_of if n.split("@")[0].split("#")[0] == "infinity"
                if (v := _rps(pts_of, n)) is not None}
    ours = {n: v for n in pts_of if n.split("#")[0] in ("lorafleet", "lorafleet@auto", "openai-base64")
            if (v := _rps(pts_of, n)) is not None}
    if infinity and ours:
        best_inf = max(infinity, key=lambda n: infinity[n])
        mine = next(n for n in ("lorafleet@auto", "lorafleet", "openai-base64") if n in ours)
        r = round(ours[mine] / infinity[best_inf], 3)
        need = PRECISION_C32["infinity"]
        targets[f"tuned_ge_{need}x_best_infinity_at_c32"] = {"ratio": r, "lorafleet": mine, "infinity": best_inf,
                                                             "met": r >= need}
        per_cpu = {n: pts_of[n][32]["throughput_rps"] / sum(pts_of[n][32]["cores_used"].values())
                   for n in (mine, *infinity) if sum(pts_of[n][32].get("cores_used", {}).values()) > 0}
        inf_cpu = {n: v for n, v in per_cpu.items() if n in infinity}
        if mine in per_cpu and inf_cpu:
            best_cpu = max(inf_cpu, key=lambda n: inf_cpu[n])
            r = round(per_cpu[mine] / inf_cpu[best_cpu], 3)
            targets[f"per_cpu_s_tuned_ge_{need}x_best_infinity_at_c32"] = {"ratio": r, "infinity": best_cpu,
                                                                           "met": r >= need}
    return targets


# Issue 19: the user's path at c=32 against raw best-batch encode, and its c=1 p50 against a raw batch-1 call.
USER_TARGETS_C32 = {"openai-base64": 0.85, "openai-float": 0.8, "msgpack": 0.93}
USER_C1_MS = 3.0


def user_path_targets(out: dict[str, Any], pts_of: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    for name, need in USER_TARGETS_C32.items():
        if 32 in pts_of.get(name, {}):
            ratio = out[name]["ratio_to_raw_best"]["32"]
            targets[f"{name}_ge_{need}x_raw_best_at_c32"] = {"ratio": ratio, "met": ratio >= need}
    for name in ("openai-float", "openai-base64"):
        d = out.get(name, {}).get("c1_p50_minus_raw_batch1_ms")
        if d is not None:
            targets[f"{name}_c1_p50_within_{USER_C1_MS:g}ms_of_raw_batch1"] = {"delta_ms": d, "met": d <= USER_C1_MS}
    return targets


def _median(xs: list[float]) -> float | None:
    return round(float(np.median(xs)), 2) if xs else None


def security_cost(pts_of: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any] | None:
    """lorafleet-tls (auth + TLS) against lorafleet-open (neither), medians over their runs: throughput at
    c=32 and p50 at c=1. Targets: at most 3 % lower throughput, at most +0.5 ms."""
    def runs(base: str, level: int, key: str) -> list[float]:
        return [pts[level][key] for name, pts in pts_of.items()
                if name.split("#")[0] == base and level in pts and pts[level][key] is not None]

    tls32, open32 = _median(runs("lorafleet-tls", 32, "throughput_rps")), _median(runs("lorafleet-open", 32,
                                                                                        "throughput_rps"))
    tls1, open1 = _median(runs("lorafleet-tls", 1, "p50_ms")), _median(runs("lorafleet-open", 1, "p50_ms"))
    if None in (tls32, open32) and None in (tls1, open1):
        return None
    ratio = round(tls32 / open32, 3) if tls32 and open32 else None
    delta = round(tls1 - open1, 2) if tls1 is not None and open1 is not None else None
    return {"c32_rps": {"tls": tls32, "open": open32}, "c1_p50_ms": {"tls": tls1, "open": open1},
            "c32_throughput_ratio": ratio, "c1_p50_delta_ms": delta,
            "runs": {"tls": len(runs("lorafleet-tls", 32, "throughput_rps") or runs("lorafleet-tls", 1, "p50_ms")),
                     "open": len(runs("lorafleet-open", 32, "throughput_rps") or runs("lorafleet-open", 1, "p50_ms"))},
            "met": (ratio is None or ratio >= 0.97) and (delta is None or delta <= 0.5)}


def print_table(result: dict[str, Any]) -> None:
    raw = result["raw"]
    print(f"\nraw in-process encode ({result['model']}, {result['inputs']['description']})")
    for b, r in raw["start"]["by_batch"].items():
        print(f"  batch {b:>3}: {r['sentences_per_s']:7.1f} sentences/s   call p50 {r['call_p50_ms']:.1f} ms")
    if raw.get("end"):
        print(f"  again at the end: best batch {raw['end']['best_batch']}: {raw['end']['best_sentences_per_s']:.1f} "
              f"sentences/s (drift check)")
    s = result["summary"]
    print(f"\n{'system':<10} {'c':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'× raw best':>10} {'errors':>6} "
          f"{'loadgen CPU':>11}")
    for name, sysres in result["systems"].items():
        if "points" not in sysres:
            print(f"{name:<10} not measured: {sysres.get('error')}")
            continue
        for p in sysres["points"]:
            ratio = s[name]["ratio_to_raw_best"][str(int(p["level"]))]
            print(f"{name:<10} {int(p['level']):>4} {p['throughput_rps']:>8.1f} {fmt(p['p50_ms']):>8} "
                  f"{fmt(p['p99_ms']):>8} {ratio:>10.2f} {p['errors']:>6} {p['gen_cpu_pct']:>10.1f}%")
    print(f"\n(× raw best: against raw encode measured right before each system)\n"
          f"raw at the start: best batch {s['raw_best_batch']}: {s['raw_best_sentences_per_s']:.1f} sentences/s; "
          f"batch-1 call p50 {fmt(s['raw_batch1_p50_ms'], 2)} ms")
    for name in result["systems"]:
        if name not in s:
            continue
        v = s[name]
        line = (f"{name}: raw before it {v['raw_best_sentences_per_s']:.1f} sentences/s best batch, batch-1 p50 "
                f"{fmt(v['raw_batch1_p50_ms'], 2)} ms")
        if v["c1_p50_minus_raw_batch1_ms"] is not None:
            line += f"; c=1 p50 − raw batch-1 = {v['c1_p50_minus_raw_batch1_ms']:+.2f} ms"
        if v.get("c1_p50_minus_naive_c1_ms") is not None:
            line += f"; c=1 p50 − naive c=1 p50 = {v['c1_p50_minus_naive_c1_ms']:+.2f} ms"
        print(line)
    if s.get("ceiling_sentences_per_s"):
        ceil = s["ceiling_sentences_per_s"]
        print("sorted ceiling (encode over all sentences, mean of start and end): "
              + ", ".join(f"{p} {v:.1f} sentences/s" for p, v in ceil.items()))
        for name in result["systems"]:
            r = s.get(name, {}).get("ratio_to_ceiling")
            if r:
                print(f"  {name}: × ceiling " + "; ".join(f"{p}: " + ", ".join(f"c={c} {v:.2f}" for c, v in byc.items())
                                                         for p, byc in r.items()))
    if s.get("ceiling_per_cpu_s"):
        print("per CPU second (shared machine): ceiling " + ", ".join(f"{p} {v:.1f} sentences" for p, v in
                                                                      s["ceiling_per_cpu_s"].items()))
        for name in result["systems"]:
            v = s.get(name, {})
            if v.get("rps_per_cpu_s"):
                print(f"  {name}: " + ", ".join(f"c={c} {x:.1f} requests" for c, x in v["rps_per_cpu_s"].items())
                      + "; × ceiling per CPU second " + "; ".join(
                          f"{p}: " + ", ".join(f"{r:.2f}" for r in byc.values())
                          for p, byc in v.get("per_cpu_s_ratio_to_ceiling", {}).items()))
    for tname, t in s["targets"].items():
        print(f"target {tname}: {'MET' if t['met'] else 'MISSED'}  "
              f"{ {k: v for k, v in t.items() if k not in ('met', 'per_concurrency')} or ''}")
        for conc, v in t.get("per_concurrency", {}).items():
            print(f"    c={conc}: lorafleet/infinity throughput {v['throughput_ratio']}, "
                  f"p99 {v['p99_lorafleet_ms']} vs {v['p99_infinity_ms']} ms → {'met' if v['met'] else 'missed'}")


