"""A canary under traffic (issue 25, part 3), end to end: nats-server, a worker on the packaged MiniLM, two gateway
processes, a real MLflow store, the promote code path.

With `--canary 20` about 20 % of the route keys (X-Lorafleet-Route-Key) are answered by v2 (the response's `model`
says which), both gateways put each key on the same side, a key switches at most once per transition and never
back; `--abort` puts every key on v1, `--finish` every key on v2. Every request is answered once, with 200."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from lorafleet.core import settings
from lorafleet.core.config import BaseModelSpec, FleetConfig, WorkerConfig
from lorafleet.ops.cluster import LocalCluster
from lorafleet.registry import canary as can
from lorafleet.registry import store
from lorafleet.registry.promote import Preload, promote
from lorafleet.testing import wait_until

pytestmark = pytest.mark.integration

BASE, NAME = "all-MiniLM-L6-v2", "legal"
KEYS = [f"client-{i}" for i in range(400)]
HEADER = "X-Lorafleet-Route-Key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _round(client: httpx.Client, url: str, keys: list[str]) -> dict[str, str]:
    out = {}
    for k in keys:
        r = client.post(f"{url}/v1/embeddings", json={"model": NAME, "input": ["Miete"]}, headers={HEADER: k})
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 1
        out[k] = r.json()["model"]
    return out


def _canary_of(url: str) -> dict | None:
    rows = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    return rows.get(NAME, {}).get("canary")


def _duplicates(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith('lorafleet_gateway_dropped_results_total{reason="duplicate"}'):
            return float(line.split()[-1])
    return 0.0


class Traffic:
    """Requests cycling over the keys on one gateway in a thread; each answer recorded in order per key."""

    def __init__(self, url: str) -> None:
        self.url, self.seen = url, defaultdict(list)
        self.sent = self.answered = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            i = 0
            while not self.stop.is_set():
                k = KEYS[i % len(KEYS)]
                i += 1
                self.sent += 1
                r = client.post(f"{self.url}/v1/embeddings", json={"model": NAME, "input": ["Kauf"]},
                                headers={HEADER: k})
                if r.status_code != 200:
                    self.errors.append(r.text)
                    continue
                self.answered += 1
                self.seen[k].append(r.json()["model"])

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


def _switches(seq: list[str]) -> int:
    return sum(a != b for a, b in itertools.pairwise(seq))


def test_canary_split_under_traffic_on_two_gateways(tmp_path: Path, minilm_path: Path) -> None:
    from lorafleet.testing import make_random_adapter

    for v in (1, 2):
        path = make_random_adapter(minilm_path, tmp_path / f"adapter-v{v}", seed=80 + v, scale=2.0)
        store.register_bundle(NAME, path, base_source=str(minilm_path), base_name=BASE,
                              metrics={"test_ndcg@10": 0.4 + v / 100, "base_test_ndcg@10": 0.3})
    fleet = FleetConfig(bases=[BaseModelSpec(name=BASE, source=str(minilm_path))],
                        worker=WorkerConfig(heartbeat_s=0.5))
    quiet = Preload(timeout_s=120.0, progress=lambda _: None)
    with LocalCluster(fleet, workers=1, port=0, home=settings.home()) as c:
        kw = {"nats_url": c.nats_url, "fleet_file": c.fleet_file}
        url = c.gateway_url
        promote(NAME, "1", preload=quiet, **kw)
        port2 = _free_port()
        assert c.state is not None
        env = {**os.environ, "LORAFLEET_HOME": str(c.home), **c.state.client("gateway").env()}
        with open(tmp_path / "gateway-2.log", "wb") as log:
            gw2 = subprocess.Popen([sys.executable, "-m", "lorafleet.serve", "--fleet", str(c.fleet_file),
                                    "--nats-url", c.nats_url, "--host", "127.0.0.1", "--port", str(port2)],
                                   stdout=log, stderr=subprocess.STDOUT, env=env)
        url2 = f"http://127.0.0.1:{port2}"
        try:
            client = httpx.Client(timeout=60)

            def routes_v1(u: str) -> bool:
                try:
                    return _round(client, u, KEYS[:1]) == {KEYS[0]: f"{NAME}@1"}
                except (httpx.HTTPError, AssertionError):
                    return False

            wait_until(lambda: routes_v1(url) and routes_v1(url2), 120, "both gateways route legal")

            with Traffic(url) as traffic:  # a canary starts under traffic
                wait_until(lambda: traffic.answered >= 20, 60, "traffic flows")
                out = can.start(NAME, "2", 20, preload=quiet, **kw)
                assert (out.champion, out.canary) == ("1", "2")
                wait_until(lambda: _canary_of(url) and _canary_of(url2), 30, "both gateways apply the canary")
                mark = traffic.answered
                wait_until(lambda: traffic.answered >= mark + 50, 60, "traffic under the canary")
            one, two = _round(client, url, KEYS), _round(client, url2, KEYS)
            assert one == two  # the same key → the same version on either gateway
            on_v2 = {k for k, m in one.items() if m == f"{NAME}@2"}
            assert set(one.values()) == {f"{NAME}@1", f"{NAME}@2"}
            assert abs(len(on_v2) / len(KEYS) - 0.20) <= 0.05, len(on_v2)
            assert not traffic.errors and traffic.answered == traffic.sent
            for k, seq in traffic.seen.items():  # at most the one switch, v1 → v2, and only for a canary key
                assert _switches(seq) <= 1 and set(seq) <= {f"{NAME}@1", one[k]}, (k, seq)
            assert _round(client, url, KEYS) == one  # sticky: again the same

            with Traffic(url2) as traffic:
                can.abort(NAME, **kw)
                wait_until(lambda: _canary_of(url) is None and _canary_of(url2) is None, 30, "the canary is gone")
            assert set(_round(client, url, KEYS).values()) == {f"{NAME}@1"}
            assert set(_round(client, url2, KEYS).values()) == {f"{NAME}@1"}
            assert not traffic.errors and traffic.answered == traffic.sent
            assert all(_switches(seq) <= 1 for seq in traffic.seen.values())

            can.start(NAME, "2", 20, preload=quiet, **kw)
            wait_until(lambda: _canary_of(url) and _canary_of(url2), 30, "the second canary applies")
            assert _round(client, url2, KEYS) == one  # the same keys as the first time
            with Traffic(url) as traffic:
                done = can.finish(NAME, preload=quiet, **kw)
                assert (done.version, done.previous) == ("2", "1")
                wait_until(lambda: _canary_of(url) is None and _canary_of(url2) is None, 30, "the canary ends")
            assert set(_round(client, url, KEYS).values()) == {f"{NAME}@2"}
            assert set(_round(client, url2, KEYS).values()) == {f"{NAME}@2"}
            assert not traffic.errors and traffic.answered == traffic.sent
            for k, seq in traffic.seen.items():  # a canary key never goes back to v1
                assert _switches(seq) <= 1 and (k not in on_v2 or set(seq) == {f"{NAME}@2"}), (k, seq)
            assert store.alias_version(NAME, "champion") == "2"
            assert _duplicates(url) == 0 and _duplicates(url2) == 0  # nothing answered twice
        finally:
            gw2.terminate()
            gw2.wait(30)
