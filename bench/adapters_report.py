"""Ratios, targets and the printed summary of bench/adapters.py (issue 16's targets)."""

from __future__ import annotations

from typing import Any

from lorafleet.bench.common import fmt

FEATURES = ("mixed_adapter_batches", "adapter_device_bytes", "adapter_host_bytes", "max_batch_adapters")
VERDICT = {True: "MET", False: "MISSED", None: "not measured"}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or not b:
        return None
    return round(a / b, 3)


def _cell(cells: dict[str, Any], mode: str, workers: int, n: int, traffic: str) -> dict[str, Any] | None:
    c = cells.get(f"{mode}/w{workers}/n{n}/{traffic}")
    return c if c and "error" not in c else None


def _pair(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, float | None] | None:
    if a is None or b is None:
        return None
    return {"saturation": _ratio(a["saturation_rps"], b["saturation_rps"]),
            "max_rate_within_slo": _ratio(a["max_rate_within_slo"], b["max_rate_within_slo"])}


def p99_at_same_rate(many: dict[str, Any] | None, one: dict[str, Any] | None) -> dict[str, Any] | None:
    """p99 of `many` over p99 of `one` at each rate both measured (overload points left out).

    The headline is the highest such rate at which the single-adapter run met the SLO: the comparison
    the target means (a loaded but not overloaded worker).
    """
    if many is None or one is None:
        return None
    a = {p["level"]: p for p in many["points"] if not p["overload"] and p["p99_ms"] is not None}
    b = {p["level"]: p for p in one["points"] if not p["overload"] and p["p99_ms"] is not None}
    common = sorted(set(a) & set(b))
    if not common:
        return None
    by_rate = {str(r): {"p99_many_ms": a[r]["p99_ms"], "p99_one_ms": b[r]["p99_ms"],
                        "ratio": _ratio(a[r]["p99_ms"], b[r]["p99_ms"])} for r in common}
    ok = [r for r in common if b[r]["meets_slo"]] or common
    head = max(ok)
    return {"rate": head, **by_rate[str(head)], "by_rate": by_rate}


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    cells = result["cells"]
    ns = result["setup"]["ns"]
    ref = 64 if 64 in ns else max(ns)
    big = max(ns)
    out: dict[str, Any] = {"reference_n": ref, "largest_n": big, "ratios": {}}
    for w in (1, 2):
        for traffic in ("uniform", "zipf"):
            mixed = _cell(cells, "mixed", w, ref, traffic)
            pair_today = _pair(mixed, _cell(cells, "today", w, ref, traffic))
            pair_before = _pair(mixed, _cell(cells, "before", w, ref, traffic))
            if pair_before:
                out["ratios"][f"mixed/before n{ref} {traffic} w{w}"] = pair_before
            pair_ceiling = _pair(mixed, _cell(cells, "ceiling", w, 0, "none"))
            if pair_today:
                out["ratios"][f"mixed/today n{ref} {traffic} w{w}"] = pair_today
            if pair_ceiling:
                out["ratios"][f"mixed/ceiling n{ref} {traffic} w{w}"] = pair_ceiling
    cmp = p99_at_same_rate(_cell(cells, "mixed", 1, big, "zipf"), _cell(cells, "mixed", 1, 1, "uniform"))
    out[f"p99 n{big} zipf warm / n1"] = cmp
    # The "today" is the runtime before mixed batches (the `before` contender); `today` is one adapter
    # per batch on this runtime, whose switches no longer grow with the adapters loaded.
    ratios = out["ratios"]
    sat_today = ratios.get(f"mixed/before n{ref} uniform w1") or ratios.get(f"mixed/today n{ref} uniform w1")
    sat_ceiling = out["ratios"].get(f"mixed/ceiling n{ref} uniform w1")
    exact = ref == 64 and big == 512
    out["targets"] = {
        "mixed_ge_2x_today_saturation_at_64": {
            "value": sat_today and sat_today["saturation"],
            "met": None if not (sat_today and sat_today["saturation"]) else sat_today["saturation"] >= 2.0},
        "mixed_ge_0.85x_ceiling_saturation_at_64": {
            "value": sat_ceiling and sat_ceiling["saturation"],
            "met": None if not (sat_ceiling and sat_ceiling["saturation"]) else sat_ceiling["saturation"] >= 0.85},
        "p99_512_zipf_warm_within_1.5x_single": {
            "value": cmp and cmp["ratio"], "met": None if not (cmp and cmp["ratio"]) else cmp["ratio"] <= 1.5},
    }
    if not exact:
        out["targets_note"] = f"measured at N={ref} and N={big}, not the targets' 64 and 512 (--quick or --ns)"
    return out


def print_summary(result: dict[str, Any]) -> None:
    st = result["setup"]
    print(f"\nall-MiniLM-L6-v2, SLO p99 ≤ {st['slo_p99_ms']:g} ms, {st['thread_plan']}; "
          f"profile fields present: {', '.join(st['profile_fields_present']) or 'none'}")
    print(f"{'cell':<28} {'max rate ≤ SLO':>15} {'saturation':>11} {'p99 @ max':>10}")
    for key, c in result["cells"].items():
        if "error" in c:
            print(f"{key:<28} not measured: {c['error'][:90]}")
            continue
        at = next((p for p in c["points"] if p["level"] == c["max_rate_within_slo"] and not p["overload"]), None)
        print(f"{key:<28} {fmt(c['max_rate_within_slo']):>13}/s {c['saturation_rps']:>9.1f}/s "
              f"{fmt(at['p99_ms'] if at else None):>8}ms")
    s = result["summary"]
    for k, v in s["ratios"].items():
        print(f"{k}: saturation ×{fmt(v['saturation'], 2)}, rate within SLO ×{fmt(v['max_rate_within_slo'], 2)}")
    cmp = s.get(f"p99 n{s['largest_n']} zipf warm / n1")
    if cmp:
        print(f"p99 of N={s['largest_n']} Zipf (warm) / N=1 at {cmp['rate']}/s: {cmp['p99_many_ms']} / "
              f"{cmp['p99_one_ms']} ms = ×{fmt(cmp['ratio'], 2)}")
    sc = result.get("scale")
    if sc and "error" not in sc:
        r, c = sc["rss_mib"], sc["churn"]
        print(f"scale: {sc['adapters_registered']} adapters, {c['adapters_touched']} touched in {c['seconds']}s "
              f"({c['throughput_rps']}/s, p50 {c['p50_ms']} ms); worker RSS {r['start']} → peak {r['peak']} MiB, "
              f"+{r.get('growth_second_half_of_walk', '-')} MiB over the walk's second half (weights touched: "
              f"{sc['weights_of_adapters_touched_mib']} MiB)")
        print(f"  request latency p50: cold (first use) {sc['cold_first_request']['p50_ms']} ms, warm (next use) "
              f"{sc['warm_second_request']['p50_ms']} ms, recently evicted {sc['recently_evicted']['p50_ms']} ms, "
              f"long evicted {sc['revisit_long_evicted']['p50_ms']} ms")
    elif sc:
        print(f"scale: failed: {sc['error'][:200]}")
    for k, t in s["targets"].items():
        print(f"target {k}: {VERDICT[t['met']]} ({fmt(t['value'], 2) if t['value'] is not None else '-'})")
    if "targets_note" in s:
        print(f"({s['targets_note']})")
