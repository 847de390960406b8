"""Node loss on a replicated queue: a 3-node JetStream cluster (R3 streams and fleet bucket), the packaged
MiniLM worker and the gateway, started as `lorafleet up --nats-nodes 3` starts them (LocalCluster).

Steady open-loop load through the gateway for 60 s, one unique input per request; `kill -9` the node that
leads the work stream at 20 s, start it again at 40 s. Every request must be answered once, with the
embedding of its own input; the stream must answer throughout and store each task once; the restarted node
must catch up. The latency per 5 s window (the failover spike) is printed and written to
`<tmp>/node_loss.json` (run with `-s` to see it, or read the path printed at the end).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgpack
import nats
import numpy as np
import pytest

from lorafleet.core.config import BaseModelSpec, FleetConfig
from lorafleet.nats.client import ClientSettings, server_urls
from lorafleet.ops.cluster import LocalCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BASE = "all-MiniLM-L6-v2"
DURATION_S, KILL_AT_S, RESTART_AT_S, WINDOW_S = 60.0, 20.0, 40.0, 5.0
RATE = 8.0  # requests/s: well inside one worker's capacity on two shared cores, so latency shows the failover
WORDS = ["Kauf", "Miete", "Vertrag", "Schuld", "Erbe", "Pfand", "Bürgschaft", "Darlehen", "Pacht", "Leihe",
         "Schenkung", "Tausch", "Werk", "Dienst", "Auftrag", "Vollmacht", "Frist", "Kündigung", "Mangel", "Schaden",
         "Zins", "Hypothek", "Grundstück", "Besitz", "Eigentum", "Verjährung", "Anfechtung", "Irrtum", "Täuschung",
         "Drohung", "Vertreter", "Verein", "Stiftung", "Gesellschaft", "Anspruch", "Einrede", "Urteil", "river",
         "mountain", "violin", "engine", "harvest", "lantern", "glacier", "orbit", "pepper", "canvas"]


def unique_text(i: int) -> str:
    """A distinct sentence per request (its number, and words drawn by it), so answers cannot be swapped unseen."""
    rng = random.Random(i)
    return f"Fall {i}: " + " ".join(rng.sample(WORDS, 6))


@dataclass
class Answer:
    i: int
    sent: float  # seconds since the load started
    status: int  # 0: no HTTP answer
    latency_ms: float
    vector: np.ndarray | None
    error: str = ""  # the body of a failed answer: which refusal it was


async def steady_load(url: str, rate: float, duration_s: float) -> list[Answer]:
    """Open loop: request i leaves at i / rate, whatever the earlier ones do."""
    answers: list[Answer] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int) -> None:
            t0 = time.perf_counter()
            status, vector, error = 0, None, ""
            try:
                r = await client.post(f"/v1/encode/{BASE}", content=msgpack.packb({"inputs": [unique_text(i)]}),
                                      headers={"Content-Type": "application/msgpack"})
                status = r.status_code
                if status == 200:
                    vector = np.frombuffer(msgpack.unpackb(r.content)["vectors"][0], dtype="<f4")
                else:
                    error = r.text[:300]
            except httpx.HTTPError as exc:
                error = repr(exc)
            answers.append(Answer(i, t0 - start, status, (time.perf_counter() - t0) * 1000.0, vector, error))

        tasks = []
        for i in range(int(rate * duration_s)):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return answers


def windows(answers: list[Answer]) -> list[dict[str, Any]]:
    """Latency per WINDOW_S window of send time: the failover spike in numbers."""
    out = []
    for w in range(int(DURATION_S / WINDOW_S)):
        lat = np.array([a.latency_ms for a in answers if w * WINDOW_S <= a.sent < (w + 1) * WINDOW_S])
        if not len(lat):
            continue
        out.append({"from_s": w * WINDOW_S, "n": len(lat), "p50_ms": round(float(np.percentile(lat, 50)), 1),
                    "p99_ms": round(float(np.percentile(lat, 99)), 1), "max_ms": round(float(lat.max()), 1)})
    return out


class StreamProbe:
    """Asks the work stream for its state once a second through the cluster (admin): is it available?"""

    def __init__(self, cluster: LocalCluster, stream: str) -> None:
        self.cluster, self.stream = cluster, stream
        self.longest_gap_s = 0.0
        self.first_seq = 0
        self.nc: Any = None

    async def open(self) -> None:
        self.nc = await nats.connect(server_urls(self.cluster.nats_url), reconnect_time_wait=0.2,
                                     max_reconnect_attempts=-1, **self.cluster.client_options("admin"))
        self.first_seq = (await self.info()).state.last_seq

    async def info(self) -> Any:
        return await self.nc.jetstream().stream_info(self.stream)

    async def watch(self, until: float) -> None:
        last_ok = time.monotonic()
        while time.monotonic() < until:
            try:
                await asyncio.wait_for(self.info(), 2.0)
                last_ok = time.monotonic()
            except Exception:
                self.longest_gap_s = max(self.longest_gap_s, time.monotonic() - last_ok)
            await asyncio.sleep(0.5)

    async def leader(self) -> str:
        return (await self.info()).cluster.leader


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    fleet = FleetConfig(bases=[BaseModelSpec(name=BASE)])
    c = LocalCluster(fleet, workers=1, port=0, home=tmp_path_factory.mktemp("nats-cluster-home"), nats_nodes=3)
    c.start(timeout=240)
    try:
        yield c
    finally:
        c.stop()


def test_cluster_layout(cluster: LocalCluster) -> None:
    """Three nodes, every part given every node's URL, R3 streams and fleet bucket."""
    from lorafleet.ops.processes import find_parts

    assert set(cluster.nats_servers) == {"nats-server-1", "nats-server-2", "nats-server-3"}
    assert len(server_urls(cluster.nats_url)) == 3
    assert cluster.fleet.nats.replicas == 3
    assert {"nats-server-1", "nats-server-2", "nats-server-3", "gateway", "worker-1"} <= set(find_parts(cluster.home))

    async def replicas() -> dict[str, int]:
        nc = await nats.connect(server_urls(cluster.nats_url), **cluster.client_options("admin"))
        js = nc.jetstream()
        out = {s: (await js.stream_info(s)).config.num_replicas
               for s in (cluster.fleet.queue.stream, cluster.fleet.queue.dlq_stream, "KV_lorafleet_fleet")}
        await nc.close()
        return out

    assert asyncio.run(replicas()) == {"LORAFLEET_WORK": 3, "LORAFLEET_DLQ": 3, "KV_lorafleet_fleet": 3}


def test_a_new_credential_is_admitted_by_every_node(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """`lorafleet creds add` on a running 3-node cluster reloads every node from what cluster.json recorded (the
    routes included), so the new key works on whichever node a client reaches, and the cluster stays whole."""
    from typer.testing import CliRunner

    from lorafleet.cli import app
    from lorafleet.ops.processes import find_parts

    monkeypatch.setenv("LORAFLEET_HOME", str(cluster.home))
    pids = {n: p for n, p in find_parts(cluster.home).items() if n.startswith("nats-server")}
    out = CliRunner().invoke(app, ["creds", "add", "worker-extra"])
    assert out.exit_code == 0, out.output
    assert all(f"{name} (pid {pid})" in out.output for name, pid in pids.items()), out.output
    assert {n: p for n, p in find_parts(cluster.home).items() if n.startswith("nats-server")} == pids  # reloaded

    async def info_on(url: str) -> int:
        nc = await nats.connect(url, allow_reconnect=False,
                                **ClientSettings(cluster.home / "creds" / "worker-extra.nk", None).options())
        try:
            return (await nc.jetstream().stream_info(cluster.fleet.queue.stream)).config.num_replicas
        finally:
            await nc.close()

    for url in server_urls(cluster.nats_url):  # each node, alone: the key and the R3 stream are there
        assert asyncio.run(info_on(url)) == 3


def test_node_loss_loses_nothing(cluster: LocalCluster, minilm_path: Path, tmp_path: Path) -> None:
    stream = cluster.fleet.queue.stream
    probe = StreamProbe(cluster, stream)
    events: dict[str, Any] = {}

    async def scenario() -> list[Answer]:
        await probe.open()
        victim = "nats-server-" + (await probe.leader()).removeprefix("n")  # the worst node to lose
        events["victim"] = victim
        t0 = time.monotonic()

        async def chaos() -> None:
            await asyncio.sleep(KILL_AT_S)
            cluster.kill(victim)  # SIGKILL to its process group
            events["killed_at_s"] = round(time.monotonic() - t0, 2)
            await asyncio.sleep(RESTART_AT_S - KILL_AT_S)
            events["leader_while_down"] = await probe.leader()
            await asyncio.to_thread(cluster.respawn, victim)  # same ports and store: it rejoins
            events["restarted_at_s"] = round(time.monotonic() - t0, 2)

        load = asyncio.create_task(steady_load(cluster.gateway_url, RATE, DURATION_S))
        await asyncio.gather(chaos(), probe.watch(t0 + DURATION_S))
        answers = await load
        # The restarted node catches up: every replica current again, nothing left in the work queue.
        deadline = time.monotonic() + 30.0
        while True:
            info = await probe.info()
            peers = info.cluster.replicas or []
            if len(peers) == 2 and all(p.current for p in peers) and info.state.messages == 0:
                break
            assert time.monotonic() < deadline, f"the cluster did not settle: {info.cluster}, {info.state}"
            await asyncio.sleep(0.5)
        events["stored"] = info.state.last_seq - probe.first_seq
        await probe.nc.close()
        return answers

    answers = asyncio.run(scenario())
    report = {"events": events, "longest_stream_gap_s": round(probe.longest_gap_s, 2), "rate_rps": RATE,
              "windows": windows(answers)}
    out = tmp_path / "node_loss.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"\nnode loss ({out}):\n{json.dumps(report, indent=2)}")

    sent = int(RATE * DURATION_S)
    assert sorted(a.i for a in answers) == list(range(sent))  # one HTTP answer per request
    failed = [(a.i, a.status, a.error) for a in answers if a.status != 200]
    assert not failed, f"{len(failed)} request(s) not answered with 200: {failed[:10]}"
    assert events["stored"] == sent, f"the work stream stored {events['stored']} tasks for {sent} requests"
    assert probe.longest_gap_s < 15.0, "the work stream did not answer for too long"
    assert "n" + events["victim"].removeprefix("nats-server-") != events["leader_while_down"]  # it failed over

    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_path), device="cpu")
    ref = model.encode([unique_text(i) for i in range(sent)], batch_size=64, normalize_embeddings=True)
    got = np.stack([a.vector for a in sorted(answers, key=lambda a: a.i)])
    got = got / np.linalg.norm(got, axis=1, keepdims=True)
    sims = got @ ref.T
    assert (sims.argmax(axis=1) == np.arange(sent)).all(), "an answer carries another request's embedding"
    assert np.diag(sims).min() > 0.9999
