"""bench/serve.py --quick: raw encode, the cluster and the naive server, end to end."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_serve_quick_writes_results(run_quick) -> None:  # type: ignore[no-untyped-def]
    data = run_quick("serve")
    assert data["raw"]["start"]["best_sentences_per_s"] > 0
    for name in ("lorafleet", "naive"):
        system = data["systems"][name]
        assert "points" in system, system
        assert system["min_cosine"] > 0.999
        assert all(p["requests"] > 0 for p in system["points"])
