"""Automatic rollback (issue 25, part 4), end to end: nats-server, one gateway, a worker on the packaged MiniLM, a
real MLflow store, the watch code path.

The candidate's adapter is corrupted in the store after registration (its canary starts without a preload), so
every request a canary key sends fails on the worker. Under light traffic over many route keys, `watch` hears the
figures from the gateway over NATS, aborts the canary within its window and says why; the champion answers every
one of its keys throughout; the reason is tagged on the candidate's model version."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest

from lorafleet.core import heartbeats, settings
from lorafleet.core.config import BaseModelSpec, FleetConfig, WorkerConfig
from lorafleet.core.fleet_state import route_bucket
from lorafleet.ops.cluster import LocalCluster
from lorafleet.registry import canary as can
from lorafleet.registry import store
from lorafleet.registry.promote import Preload, _connect, control_client, promote
from lorafleet.registry.watch import ABORT_TAG, Margins, watch
from lorafleet.serve.resolver import route_key
from lorafleet.testing import wait_until

pytestmark = pytest.mark.integration

BASE, NAME = "all-MiniLM-L6-v2", "tenancy"
KEYS = [f"client-{i}" for i in range(200)]
HEADER = "X-Lorafleet-Route-Key"
PERCENT = 30.0


class Traffic:
    """A few requests a second over many keys, in a thread; failures recorded per side of the split."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.champion_failures: list[str] = []
        self.champion_ok = 0
        self.canary_codes: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            i = 0
            while not self.stop.is_set():
                k = KEYS[i % len(KEYS)]
                i += 1
                r = client.post(f"{self.url}/v1/embeddings", json={"model": NAME, "input": ["Miete"]},
                                headers={HEADER: k})
                if route_bucket(NAME, route_key(k, None, None)) >= PERCENT or r.json().get("model") == f"{NAME}@1":
                    if r.status_code == 200:
                        self.champion_ok += 1
                    else:
                        self.champion_failures.append(f"{k}: {r.status_code} {r.text[:200]}")
                else:
                    self.canary_codes.append(r.status_code)
                self.stop.wait(0.1)  # light traffic: a few requests a second

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


def _corrupt_new_adapters(root: Path, before: set[Path]) -> int:
    """Overwrite the adapter weights stored since `before` (the candidate's) with garbage."""
    n = 0
    for p in root.rglob("*.safetensors"):
        if p not in before:
            p.write_bytes(b"not a safetensors file")
            n += 1
    return n


def test_watch_aborts_a_failing_canary_and_the_champion_keeps_answering(tmp_path: Path, minilm_path: Path) -> None:
    from lorafleet.testing import make_random_adapter

    artifacts = settings.home() / "mlflow"
    v1 = make_random_adapter(minilm_path, tmp_path / "adapter-v1", seed=91, scale=2.0)
    store.register_bundle(NAME, v1, base_source=str(minilm_path), base_name=BASE,
                          metrics={"test_ndcg@10": 0.41, "base_test_ndcg@10": 0.3})
    before = set(artifacts.rglob("*.safetensors"))
    v2 = make_random_adapter(minilm_path, tmp_path / "adapter-v2", seed=92, scale=2.0)
    store.register_bundle(NAME, v2, base_source=str(minilm_path), base_name=BASE,
                          metrics={"test_ndcg@10": 0.42, "base_test_ndcg@10": 0.3})
    assert _corrupt_new_adapters(artifacts, before) >= 1

    fleet = FleetConfig(bases=[BaseModelSpec(name=BASE, source=str(minilm_path))],
                        worker=WorkerConfig(heartbeat_s=0.5))
    with LocalCluster(fleet, workers=1, port=0, home=settings.home()) as c:
        kw = {"nats_url": c.nats_url, "fleet_file": c.fleet_file}
        url = c.gateway_url
        promote(NAME, "1", preload=Preload(timeout_s=120.0, progress=lambda _: None), **kw)

        def serves_v1() -> bool:
            try:
                r = httpx.post(f"{url}/v1/embeddings", json={"model": NAME, "input": ["x"]}, timeout=30)
                return r.status_code == 200 and r.json()["model"] == f"{NAME}@1"
            except httpx.HTTPError:
                return False

        wait_until(serves_v1, 120, "the gateway serves v1")
        # no preload: the corrupt candidate reaches the split, as a bad bundle would past a skipped preload
        can.start(NAME, "2", PERCENT, preload=Preload(enabled=False), **kw)

        said: list[str] = []
        watched: list[dict] = []

        async def heard() -> dict[str, dict]:
            nc = await _connect(c.nats_url, control_client(c.state))
            try:
                return {k: asdict(p) for k, p in (await heartbeats.collect_presence(nc)).items()}
            finally:
                await nc.close()

        def spy() -> None:  # while it watches, the fleet state names the watcher and status hears it
            client = control_client(c.state)
            for _ in range(200):
                rows = asyncio.run(can.read_canaries(c.nats_url, client))
                if rows and rows[0]["watcher"]:
                    watched.append({**rows[0], "line": can.watch_line(rows[0], asyncio.run(heard()))})
                    return
                time.sleep(0.1)

        spy_thread = threading.Thread(target=spy, daemon=True)
        with Traffic(url) as traffic:
            spy_thread.start()
            t0 = time.monotonic()
            out = watch(NAME, 60.0, Margins(min_requests=5), every_s=1.0, say=said.append, **kw)
            elapsed = time.monotonic() - t0
            mark = traffic.champion_ok
            wait_until(lambda: traffic.champion_ok >= mark + 5, 30, "the champion answers after the abort")
        spy_thread.join(30)

        assert out.result == "aborted", out
        assert elapsed < 60.0
        assert "error rate" in out.reason and "v2" in out.reason, out.reason
        assert out.candidate.errors >= 5 and out.candidate.error_rate > 0.5
        assert out.champion.requests >= 1 and out.champion.errors == 0
        assert said and "watching canary v2" in said[0]
        assert watched and watched[0]["watch_until"] > time.time() - 60
        assert watched[0]["line"].startswith(f"watched by {watched[0]['watcher']} until"), watched
        assert sum(code >= 500 for code in traffic.canary_codes) >= 5, traffic.canary_codes
        assert not traffic.champion_failures, traffic.champion_failures[:5]
        assert asyncio.run(can.read_canaries(c.nats_url, control_client(c.state))) == []
        assert store.alias_version(NAME, "champion") == "1"
        tags = store.client().get_model_version(NAME, "2").tags
        assert "error rate" in tags.get(ABORT_TAG, "")
