"""bench/serve.py --quick: raw encode and the user's path (a cluster as `lorafleet up` starts it, the OpenAI
route with float and base64, the MessagePack route), end to end; plus the naive server as a second system."""

from __future__ import annotations

import pytest

from lorafleet.bench.serve import USER_ROUTES

pytestmark = pytest.mark.integration


def test_serve_quick_measures_the_users_path(run_quick) -> None:  # type: ignore[no-untyped-def]
    data = run_quick("serve", "--contenders", ",".join([*USER_ROUTES, "naive"]), timeout=240)
    assert data["raw"]["start"]["best_sentences_per_s"] > 0
    for name in (*USER_ROUTES, "naive"):
        system = data["systems"][name]
        assert "points" in system, system
        assert system["min_cosine"] > 0.999
        assert all(p["requests"] > 0 and p["errors"] == 0 for p in system["points"])
    for name in USER_ROUTES:
        point = data["systems"][name]["points"][0]
        # CPU per process, so a report can say where the cores went.
        assert {"worker-1", "gateway", "nats-server"} <= set(point["cores_used"])
        assert "torch thread(s) per worker" in data["systems"][name]["threads"]
    # c=1 is measured in quick mode, so the latency targets are judged (the throughput ones need c=32).
    assert "openai-base64_c1_p50_within_3ms_of_raw_batch1" in data["summary"]["targets"]


def _point(rps: float, cores: dict[str, float] | None = None) -> dict[str, object]:
    return {"level": 32, "throughput_rps": rps, "p50_ms": 100.0, "p99_ms": 200.0, "errors": 0, "gen_cpu_pct": 1.0,
            **({"cores_used": cores} if cores else {})}


def test_precision_targets_against_the_sorted_ceiling_the_fp32_cluster_and_infinity() -> None:
    """Issue 27's targets, in wall-clock and per CPU second (a shared machine gives each process a share)."""
    from lorafleet.bench.serve_report import summarise

    raw = {"best_batch": 16, "best_sentences_per_s": 100.0, "batch1_p50_ms": 10.0}
    systems = {
        "openai-base64": {"points": [_point(250.0, {"worker-1": 0.9, "gateway": 0.08, "nats-server": 0.02})]},
        "openai-base64@fp32": {"points": [_point(110.0, {"worker-1": 0.9, "gateway": 0.08, "nats-server": 0.02})]},
        "openai-base64@auto:old": {"points": [_point(200.0, {"worker-1": 1.0})]},
        "infinity@float32": {"points": [_point(90.0, {"server": 1.0})]},
        "infinity@bfloat16": {"points": [_point(160.0, {"server": 1.0})]},
    }
    out = summarise(raw, systems, ceiling={"fp32": 120.0, "bf16": 300.0}, ceiling_per_cpu_s={"fp32": 125.0})
    t = out["targets"]
    assert t["auto_base64_ge_2.0x_fp32_ceiling_at_c32"] == {"ratio": 2.083, "met": True}
    assert t["auto_base64_ge_1.9x_fp32_cluster_at_c32"] == {"ratio": 2.273, "met": True}
    assert t["auto_base64_against_pre_issue27_worker_at_c32"] == {"ratio": 1.25, "met": True}
    # The best infinity setting is the one compared: 250 / 160.
    assert t["tuned_ge_1.5x_best_infinity_at_c32"]["infinity"] == "infinity@bfloat16"
    assert t["tuned_ge_1.5x_best_infinity_at_c32"]["ratio"] == 1.562
    assert out["openai-base64"]["rps_per_cpu_s"] == {"32": 250.0}
    assert t["per_cpu_s_auto_base64_ge_2.0x_fp32_ceiling_at_c32"] == {"ratio": 2.0, "met": True}
    assert t["per_cpu_s_tuned_ge_1.5x_best_infinity_at_c32"]["ratio"] == 1.562
    assert out["openai-base64"]["ratio_to_ceiling"]["bf16"] == {"32": 0.833}
