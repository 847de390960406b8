"""A worker's Prometheus metrics and its presence: a real worker process (tiny model, real LoRA adapters) on a
real nats-server, scraped over HTTP on `/metrics`."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sidecar_testkit import BASE, WorkerProcess, fleet_dict
from test_sidecar_worker_integration import make_task, reply_to, roundtrip

from lorafleet.core.heartbeats import ENV_RESTARTS, Presence
from lorafleet.core.wire import presence_subject
from lorafleet.nats.server import NatsServer
from lorafleet.sidecar import metrics as m
from lorafleet.sidecar.metrics import MetricsServer, WorkerMetrics
from lorafleet.testing import wait_until


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """sample name and labels → value, from a real HTTP scrape."""
    r = httpx.get(url, timeout=5.0)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text[:200]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_worker_metrics_server_serves_the_registry_and_closes() -> None:
    metrics = WorkerMetrics(["b1"])
    metrics.task_settled("b1", "ok")
    for outcome in ("runtime_failed", "runtime_failed", "adapter_unavailable", "cancelled"):
        metrics.task_settled("b1", outcome)
    metrics.batch_done("b1", 3, 0.02)
    metrics.watch(lambda: 7.0, {"b1": lambda: (2, 8)})
    server = MetricsServer(metrics, "127.0.0.1", 0)
    try:
        samples = scrape(server.url)
        assert value(samples, f"{m.TASKS}_total", base="b1", outcome="ok") == 1.0
        assert value(samples, f"{m.ERRORS}_total", base="b1", code="runtime_failed") == 2.0  # failures, by code
        assert value(samples, f"{m.ERRORS}_total", base="b1", code="adapter_unavailable") == 1.0
        assert not any(name == f"{m.ERRORS}_total" and ("code", c) in labels for (name, labels) in samples
                       for c in ("ok", "cancelled"))  # flow, not failures
        assert value(samples, f"{m.BATCH_SIZE}_sum", base="b1") == 3.0
        assert value(samples, m.TASKS_IN_FLIGHT) == 7.0
        assert value(samples, m.SLOTS_IN_USE, base="b1") == 2.0 and value(samples, m.SLOTS, base="b1") == 8.0
        with pytest.raises(OSError, match="--metrics-port"):  # the port is taken: a clear error, not a traceback
            MetricsServer(metrics, "127.0.0.1", server.port)
    finally:
        server.close()
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url, timeout=2.0)


@pytest.mark.integration
def test_a_worker_counts_tasks_batches_and_adapters(tmp_path: Path, tiny_model_dir: Path,
                                                    tiny_adapters: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    server = NatsServer(tmp_path / "nats").start()
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(fleet_dict(tiny_model_dir, tiny_adapters, max_adapters=1)))
    monkeypatch.setenv(ENV_RESTARTS, "3")  # what the supervisor gives a part it restarted
    worker = WorkerProcess(fleet_file, server.url, "mtest", tmp_path / "worker.log",
                           args=("--metrics-port", "0"))
    try:
        worker.wait_ready()
        found = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", worker.log())
        assert found, worker.log()
        url = found.group(1)
        before = scrape(url)
        assert value(before, f"{m.TASKS}_total", base=BASE, outcome="ok") == 0.0  # exported before any task
        assert value(before, m.TASKS_IN_FLIGHT) == 0.0

        texts = ["Der Verkäufer einer Sache ist verpflichtet.", "Die Kündigung bedarf der Schriftform.", "kurz"]
        first = [make_task(t, reply_to()) for t in texts] + [make_task(t, reply_to(), adapter="a") for t in texts[:2]]
        first.append(make_task("zu spät", reply_to(), deadline_s=-1.0))  # expired in the queue
        results = asyncio.run(roundtrip(server.url, first))
        assert len(results) == len(first), worker.log()
        second = [make_task(t, reply_to(), adapter="b", adapter_uri=str(tiny_adapters["b"])) for t in texts[:2]]
        assert all(r.ok for r in asyncio.run(roundtrip(server.url, second)))  # loads b, evicts a (max_adapters 1)

        def seven_ok() -> dict | None:  # the last settle (ack) follows the receipt
            samples = scrape(url)
            return samples if value(samples, f"{m.TASKS}_total", base=BASE, outcome="ok") >= 7 else None

        after = wait_until(seven_ok, 10.0, "seven tasks settled ok")
        assert value(after, f"{m.TASKS}_total", base=BASE, outcome="ok") == 7.0
        assert value(after, f"{m.TASKS}_total", base=BASE, outcome="deadline") == 1.0
        assert value(after, f"{m.ERRORS}_total", base=BASE, code="deadline") == 1.0  # the one failure, by its code
        assert value(after, f"{m.BATCH_SIZE}_sum", base=BASE) == 7.0  # the expired task never reached a batch
        assert value(after, f"{m.BATCH_SIZE}_count", base=BASE) >= 3  # base, a and b never share a batch
        assert value(after, f"{m.BATCH_SECONDS}_count", base=BASE) == value(after, f"{m.BATCH_SIZE}_count", base=BASE)
        assert value(after, f"{m.BATCH_SECONDS}_sum", base=BASE) > 0.0
        assert value(after, f"{m.ADAPTER_LOADS}_total", base=BASE) == 2.0
        assert value(after, f"{m.ADAPTER_EVICTIONS}_total", base=BASE) == 1.0
        assert value(after, m.ADAPTERS_LOADED, base=BASE) == 1.0
        assert value(after, m.TASKS_IN_FLIGHT) == 0.0

        presence = asyncio.run(_presence(server.url, "mtest"))
        assert (presence.role, presence.state, presence.restarts) == ("worker", "serving", 3)
        assert presence.pid == worker.proc.pid and presence.host
    finally:
        rc = worker.stop()
        server.stop()
    assert rc == 0, worker.log()


async def _presence(url: str, worker_id: str) -> Presence:
    import nats

    nc = await nats.connect(url)
    try:
        sub = await nc.subscribe(presence_subject("worker", worker_id))
        return Presence.from_wire((await sub.next_msg(timeout=5.0)).data)
    finally:
        await nc.close()
