"""Preload on promote (issue 16), end to end: a real local cluster (nats-server, two worker processes on the tiny
BERT, the gateway), a real MLflow store. A promotion under steady traffic loads the new version on every
worker before the fleet switches, so every request is answered and none to the new version waits for a
download: the workers never load it on demand, and each logged its preload before the switch."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
import pytest

from lorafleet.core import settings
from lorafleet.core.config import BaseModelSpec, FleetConfig, WorkerConfig
from lorafleet.ops.cluster import LocalCluster
from lorafleet.registry import store
from lorafleet.registry.promote import Preload, promote
from lorafleet.testing import wait_until

pytestmark = pytest.mark.integration

BASE, NAME = "tiny", "legal"
TEXT = "Der Verkäufer einer Sache ist verpflichtet, dem Käufer die Sache zu übergeben."


@dataclass
class Answer:
    sent: float  # epoch seconds
    status: int
    vector: np.ndarray | None


class Traffic:
    """Steady requests to NAME from one thread, about every `every_s`, until stopped."""

    def __init__(self, url: str, every_s: float = 0.05) -> None:
        self.url, self.every_s = url, every_s
        self.answers: list[Answer] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.is_set():
                sent = time.time()
                try:
                    r = client.post("/v1/embeddings", json={"model": NAME, "input": [TEXT], "encoding_format": "float"})
                    vec = np.asarray(r.json()["data"][0]["embedding"]) if r.status_code == 200 else None
                    self.answers.append(Answer(sent, r.status_code, vec))
                except httpx.HTTPError:
                    self.answers.append(Answer(sent, 0, None))
                self.stop.wait(self.every_s)  # pacing, not synchronisation


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _logged_at(line: str) -> float:
    """Epoch seconds of a worker log line (`%(asctime)s …`, local time)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_promote_under_traffic_preloads_every_worker_before_the_switch(tmp_path: Path, tiny_model_dir: Path) -> None:
    from lorafleet.testing import make_random_adapter
    from lorafleet.train.kinds.retrieval.trainer import load_adapter_model

    adapters = {v: make_random_adapter(tiny_model_dir, tmp_path / f"adapter-v{v}", seed=40 + v,
                                       scale=4.0) for v in (1, 2)}
    for v, path in adapters.items():
        ref = store.register_bundle(NAME, path, base_source=str(tiny_model_dir), base_name=BASE,
                                    metrics={"test_ndcg@10": 0.4 + v / 100, "base_test_ndcg@10": 0.3})
        assert ref.version == str(v)
    expected = {v: np.asarray(load_adapter_model(str(tiny_model_dir), p, "cpu", 64).encode([TEXT])[0])
                for v, p in adapters.items()}
    assert _cos(expected[1], expected[2]) < 0.999, "the two versions must answer differently"
    fleet = FleetConfig(bases=[BaseModelSpec(name=BASE, source=str(tiny_model_dir), max_seq_length=64)],
                        worker=WorkerConfig(heartbeat_s=0.5))
    lines: list[str] = []
    # The cluster shares this test's LORAFLEET_HOME: its MLflow store, and the control credential promote uses.
    with LocalCluster(fleet, workers=2, port=0, home=settings.home()) as c:
        preload = Preload(timeout_s=60.0, progress=lines.append)
        first = promote(NAME, "1", nats_url=c.nats_url, fleet_file=c.fleet_file, preload=preload)
        assert first.preload is not None and len(first.preload.confirmed) == 2, lines
        traffic = Traffic(c.gateway_url)
        traffic.thread.start()
        try:
            wait_until(lambda: any(a.status == 200 for a in traffic.answers), 60, "an answer of v1")
            before = time.time()
            second = promote(NAME, "2", nats_url=c.nats_url, fleet_file=c.fleet_file, preload=preload)
            switched = time.time()  # the live entry is written just before promote returns

            def answered_by_v2() -> int:
                return sum(a.vector is not None and _cos(a.vector, expected[2]) > 0.9999 for a in traffic.answers)

            wait_until(lambda: answered_by_v2() >= 20, 60, "20 answers of v2")
        finally:
            traffic.stop.set()
            traffic.thread.join(35)
        logs = {n: c.log_path(n).read_text(errors="replace") for n in ("worker-1", "worker-2")}

    assert second.preload is not None and second.preload.complete and len(second.preload.confirmed) == 2, lines
    assert any("workers confirmed 2/2" in x for x in lines), lines
    statuses = [a.status for a in traffic.answers]
    assert statuses and set(statuses) == {200}, f"every request answered: {statuses}"
    for a in traffic.answers:  # every answer is one version or the other, never a mix or the bare base
        assert a.vector is not None and max(_cos(a.vector, expected[1]), _cos(a.vector, expected[2])) > 0.9999
    print(f"\npreload on promote: {len(statuses)} requests, all 200; promote v2 took {switched - before:.2f}s, "
          f"preload {second.preload.seconds:.2f}s on 2 workers")
    for name, log in logs.items():
        preloaded = [ln for ln in log.splitlines() if re.search(rf"adapter {NAME}@v2 preloaded on {BASE}\b", ln)]
        assert preloaded, f"{name} never preloaded {NAME}@v2:\n{log[-3000:]}"
        assert _logged_at(preloaded[0]) <= switched, f"{name} preloaded after the switch: {preloaded[0]}"
        # Computer logs every load a batch had to wait for; none may name a version that was preloaded.
        on_demand = [ln for ln in log.splitlines() if " loaded on " in ln and "preloaded" not in ln
                     and f"{NAME}@v" in ln]
        assert not on_demand, f"{name} loaded on demand: {on_demand}"
