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
