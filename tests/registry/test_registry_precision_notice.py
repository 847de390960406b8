"""`promote` compares a bundle's tuned precision with what the workers of its base serve (issue 27): "serving at
bf16 as tuned", or a downgrade notice naming the workers — never an error. The words are a pure function; one
promote runs against a real nats-server and MLflow store, with worker heartbeats published on NATS by the test."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lorafleet.registry.precision_notice import precision_notice

WAIT_S = 20.0  # upper bound on any awaited event


def test_serving_at_the_tuned_precision() -> None:
    n = precision_notice("minilm", "bf16", {"w1": "bf16", "w2": "bf16"})
    assert n is not None and n.as_tuned
    assert n.lines == ("serving at bf16 as tuned (base minilm, workers w1, w2)",)


def test_a_worker_without_bf16_is_a_downgrade_notice() -> None:
    n = precision_notice("minilm", "bf16", {"w2": "fp32", "w1": "bf16"})
    assert n is not None and not n.as_tuned
    assert n.lines[0] == "serving at bf16 as tuned on worker w1"
    assert n.lines[1].startswith("tuned at bf16, the base minilm serves fp32 on worker w2: a downgrade")
    assert "set `precision: bf16` on base minilm in the fleet file" in n.lines[1]


def test_nothing_to_say_or_nothing_heard() -> None:
    assert precision_notice("minilm", None, {"w1": "fp32"}) is None  # not tuned (or before precision was an axis)
    assert precision_notice("minilm", "auto", {"w1": "fp32"}) is None
    n = precision_notice("minilm", "bf16", {})
    assert n is not None and not n.as_tuned and "no worker of base minilm was heard" in n.lines[0]
    n = precision_notice("minilm", "bf16", {"old": None})
    assert n is not None and not n.as_tuned and "worker old of base minilm do not report" in n.lines[0]
    n = precision_notice("minilm", "fp32", {"w1": "bf16"})  # the guard kept fp32, the base serves bf16
    assert n is not None and "tuned at fp32, the base minilm serves bf16 on worker w1" in n.lines[0]
    assert "set `precision: fp32` on base minilm" in n.lines[0]


async def _bucket(url: str) -> None:
    """The fleet's KV bucket, as a gateway or worker creates it on start."""
    import nats

    from lorafleet.core.fleet_state import ensure_fleet_bucket

    nc = await nats.connect(url)
    try:
        await ensure_fleet_bucket(nc.jetstream())
    finally:
        await nc.close()


@contextmanager
def _heartbeats(url: str, worker: str, base: str, precision: str) -> Iterator[None]:
    """A worker's heartbeats, as NATS carries them, every 50 ms on a thread of its own until the block ends."""
    import nats

    from lorafleet.core.wire import Heartbeat, heartbeat_subject

    started, stop = threading.Event(), threading.Event()

    async def beat() -> None:
        nc = await nats.connect(url)
        try:
            while not stop.is_set():
                hb = Heartbeat(worker=worker, bases=[base], adapters={base: []}, in_flight=0, batches_per_s=0.0,
                               tasks_done=0, pid=1, host="test", precisions={base: precision})
                await nc.publish(heartbeat_subject(worker), hb.to_wire())
                await nc.flush()
                started.set()
                await asyncio.sleep(0.05)
        finally:
            await nc.close()

    thread = threading.Thread(target=asyncio.run, args=(beat(),), daemon=True)
    thread.start()
    assert started.wait(WAIT_S), "the fake worker's heartbeats did not start"
    try:
        yield
    finally:
        stop.set()
        thread.join(WAIT_S)


@pytest.mark.integration
def test_promote_prints_the_downgrade(nats_server, tiny_adapter: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    from lorafleet.cli import app
    from lorafleet.core.config import BaseModelSpec, FleetConfig, ServingProfile, WorkerConfig
    from lorafleet.registry import promote as prom
    from lorafleet.registry import store

    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(FleetConfig(bases=[BaseModelSpec(name="tiny", source="x")],
                                      worker=WorkerConfig(heartbeat_s=0.2)).model_dump_json())
    for score in (0.40, 0.45):
        store.register_bundle("legal", tiny_adapter, base_source=str(tiny_model_dir), base_name="tiny",
                              metrics={"test_ndcg@10": score, "base_test_ndcg@10": 0.30},
                              profile=ServingProfile(precision="bf16"), profile_source="tuned")
    url = nats_server.url
    asyncio.run(_bucket(url))
    with _heartbeats(url, "w-old-cpu", "tiny", "fp32"):
        t0 = time.monotonic()
        out = prom.promote("legal", "1", nats_url=url, fleet_file=fleet_file, preload=prom.Preload(enabled=False))
        assert time.monotonic() - t0 < WAIT_S
        assert out.precision is not None and not out.precision.as_tuned
        assert out.precision.served == (("w-old-cpu", "fp32"),)
        res = CliRunner().invoke(app, ["promote", "legal", "--version", "2", "--nats-url", url, "--fleet",
                                       str(fleet_file), "--no-preload"])
    assert res.exit_code == 0, res.output  # a notice, not an error
    assert "tuned at bf16, the base tiny serves fp32 on worker w-old-cpu: a downgrade" in res.output
    assert store.alias_version("legal", "champion") == "2"
    with _heartbeats(url, "w-new", "tiny", "bf16"):
        out = prom.rollback("legal", nats_url=url, fleet_file=fleet_file, preload=prom.Preload(enabled=False))
    assert out.precision is not None and out.precision.as_tuned
    assert out.precision.lines == ("serving at bf16 as tuned (base tiny, worker w-new)",)
