"""The queue plane as a security reviewer and an operator try it (issue 12): real nats-server with
authentication, real gateway and worker processes (the synthetic runtime, whose batch cost is
modelled, so the figures are about the queue plane and not about the two cores).

- attacks: what anonymous, gateway, control and worker credentials can and cannot do to a running fleet;
- self-healing: the work stream deleted under load, a memory store lost with its server;
- supervision: killed parts come back, `lorafleet status` and `down` see what really runs;
- admission control: 2x the service rate is shed with quick 429s, admitted work finishes in time;
- orphans: a dead gateway's queued tasks are dropped, not computed for nobody.

`LORAFLEET_OVERLOAD_S=60` runs the overload test for 60 s (CI: 10 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgpack
import nats
import numpy as np
import pytest
from queue_plane_kit import (
    BASE,
    GENUINE,
    Load,
    connect_as,
    counts,
    encode_body,
    metric,
    synth_fleet,
    until,
    worker_totals,
)

from lorafleet.core.fleet_state import FleetEntry, put_entry
from lorafleet.core.wire import FLEET_KV_BUCKET, HDR_MSG_ID, WORK_PREFIX, Result, Task, consumer_name, work_subject
from lorafleet.nats.auth import explain_connect_error, public_key_of
from lorafleet.ops.cluster import LocalCluster
from lorafleet.ops.cluster_state import ClusterState, down
from lorafleet.ops.processes import find_parts

pytestmark = pytest.mark.integration

OVERLOAD_S = float(os.environ.get("LORAFLEET_OVERLOAD_S", "10"))


def embed(cluster: LocalCluster, model: str = BASE, deadline_ms: float = 10_000) -> httpx.Response:
    return httpx.post(f"{cluster.gateway_url}/v1/encode/{model}", content=encode_body("Der Käufer zahlt.", deadline_ms),
                      timeout=30)


def vector(r: httpx.Response) -> list[float]:
    return np.frombuffer(msgpack.unpackb(r.content)["vectors"][0], dtype="<f4").tolist()


class Violations:
    def __init__(self) -> None:
        self.seen: list[str] = []

    async def on_error(self, exc: Exception) -> None:  # nats-py wants a coroutine function
        self.seen.append(str(exc))

    async def wait(self, fragment: str, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(fragment.lower() in s.lower() for s in self.seen):
            assert time.monotonic() < deadline, f"no permissions violation naming {fragment!r}: {self.seen}"
            await asyncio.sleep(0.02)


# ---- 1. nobody without the right credential owns the fleet ---------------------------------------

def test_attacks_on_a_running_fleet_fail(tmp_path: Path) -> None:
    fleet = synth_fleet(worker={"adapter_roots": [str(tmp_path / "adapters")]})
    with LocalCluster(fleet, workers=1, port=0, home=tmp_path / "home") as c:
        asyncio.run(_attacks(c))
        # A forged fleet entry (control's job, so: a stolen control credential) cannot point a worker anywhere.
        asyncio.run(_forged_fleet_entry(c))
        until(lambda: httpx.get(f"{c.gateway_url}/v1/models").text.count("german-legal") > 0, 10, "route")
        r = embed(c, "german-legal")
        assert r.status_code == 503 and r.json()["error"]["code"] == "adapter_unavailable", r.text
        assert "/etc" not in r.text and "not allowed" not in r.text  # the worker's text stays inside (issue 38)
        request_id = r.json()["error"]["request_id"]
        logged = [line for line in c.log_path("gateway").read_text(errors="replace").splitlines() if request_id in line]
        assert logged and "not allowed on this worker" in logged[0] and "/etc" in logged[0], logged
        assert "exist" not in logged[0]  # nothing said, even to the operator, about whether the path exists


def test_a_tls_cluster_serves_and_refuses_plain_connections(tmp_path: Path) -> None:
    with LocalCluster(synth_fleet(), workers=1, port=0, home=tmp_path / "home", tls=True) as c:
        assert c.nats_url.startswith("tls://") and (c.home / "tls" / "ca.pem").is_file()
        r = embed(c)
        assert r.status_code == 200 and vector(r) == GENUINE

        async def plain() -> str:
            url = c.nats_url.replace("tls://", "nats://")
            try:  # the right credential, but no TLS: the server's certificate cannot be checked
                await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                                   nkeys_seed=str(c.client("admin").creds))
            except Exception as exc:
                return explain_connect_error(exc, url)
            raise AssertionError("a plain connection to a TLS-only server succeeded")

        message = asyncio.run(plain())
        assert "requires TLS" in message and "LORAFLEET_NATS_TLS_CA" in message, message
        logs = "".join(c.log_path(n).read_text() for n in ("gateway", "worker-1"))
        assert "eof_received" not in logs  # the harmless TLS close noise is filtered


async def _attacks(c: LocalCluster) -> None:
    # Anonymous: refused at the door, with a message that says what to set.
    with pytest.raises(nats.errors.Error) as anonymous:
        await nats.connect(c.nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    assert "requires credentials" in explain_connect_error(anonymous.value, c.nats_url)

    gw_key = public_key_of(c.client("gateway").creds)  # type: ignore[arg-type]
    gw_inbox = f"_INBOX.{gw_key}"  # every gateway result inbox of this credential lies under it
    for role in ("worker", "control"):
        nc = await connect_as(c, role, error_cb=(v := Violations()).on_error)
        await nc.subscribe(">")
        await v.wait('subscription to ">"')
        await nc.subscribe(f"{gw_inbox}.>")  # the gateway's results (every user's vectors)
        await v.wait(f"subscription to \"{gw_inbox}")
        js = nc.jetstream()
        with pytest.raises((TimeoutError, nats.errors.TimeoutError)):  # a refused request gets no answer
            await asyncio.wait_for(js.delete_stream(c.fleet.queue.stream), 1.0)
        await v.wait(f"$JS.API.STREAM.DELETE.{c.fleet.queue.stream}")
        if role == "worker":
            kv = await js.key_value(FLEET_KV_BUCKET)
            with pytest.raises((TimeoutError, nats.errors.TimeoutError)):
                await asyncio.wait_for(kv.put("german-legal", b"{}"), 1.0)
            await v.wait(f"$KV.{FLEET_KV_BUCKET}.german-legal")
        await nc.close()

    # The forged-answer attack: see the task, answer before the worker. A gateway credential (a second
    # gateway's, or the victim gateway's own) can neither see tasks nor publish into any result inbox.
    attacker = await connect_as(c, "gateway", error_cb=(v := Violations()).on_error)
    await attacker.subscribe(f"{WORK_PREFIX}.>")
    await v.wait(f'subscription to "{WORK_PREFIX}.>"')
    psub = await attacker.jetstream().pull_subscribe_bind(durable=consumer_name(BASE), stream=c.fleet.queue.stream)
    with pytest.raises((TimeoutError, nats.errors.TimeoutError)):
        await psub.fetch(1, timeout=1.0)
    await v.wait("CONSUMER.MSG.NEXT")
    forged = Result("t", 0, "evil", vector=np.full(8, 9.0, dtype="<f4").tobytes(), dim=8).to_wire()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    async def spray() -> None:  # guessed reply subjects, as fast as it can
        while not stop.is_set():
            await attacker.publish(f"{gw_inbox}.x.y", forged)
            await asyncio.sleep(0.005)

    sprayer = asyncio.create_task(spray())
    victims = await asyncio.gather(*(loop.run_in_executor(None, embed, c) for _ in range(4)))
    stop.set()
    await sprayer
    await v.wait(f'publish to "{gw_inbox}.x.y"')
    assert [r.status_code for r in victims] == [200] * 4
    assert all(vector(r) == GENUINE for r in victims), "a forged vector reached a client"

    # A forged task through a stolen gateway credential: it computes nothing outside the allow-list.
    tasks = [Task(id=f"forged-{i}", request_id="rq", index=0, model=BASE, base=BASE, text="x", tokens=3,
                  deadline=time.time() + 10, reply=f"{gw_inbox}.gw-attacker.rq", adapter=f"probe-{i}",
                  adapter_uri=uri) for i, uri in enumerate(["/etc", "/nonexistent"])]
    answers = await attacker.subscribe(f"{gw_inbox}.gw-attacker.>")  # its own inbox: results may come back here
    for t in tasks:
        await attacker.jetstream().publish(work_subject(BASE), t.to_wire(), headers={HDR_MSG_ID: t.id})
    got = {}
    while len(got) < 2:
        msg = await answers.next_msg(timeout=10)
        if msg.reply:
            await attacker.publish(msg.reply, b"")
        if msg.data:
            r = Result.from_wire(msg.data)
            got[r.task_id] = r.error_message or ""
    assert got["forged-0"].replace("'/etc'", "X") == got["forged-1"].replace("'/nonexistent'", "X")
    await attacker.close()


async def _forged_fleet_entry(c: LocalCluster) -> None:
    control = await connect_as(c, "control")
    kv = await control.jetstream().key_value(FLEET_KV_BUCKET)
    await put_entry(kv, FleetEntry(name="german-legal", base=BASE, adapter_id="german-legal@v9", adapter_uri="/etc",
                                   version="9", registered_model="german-legal"))
    await control.close()


# ---- 2. self-healing ------------------------------------------------------------------------------

class Sampler:
    """Requests (closed loop) and /readyz, side by side, in background threads."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.c = cluster
        self.requests: list[tuple[float, int]] = []  # (answered at, status)
        self.started: list[tuple[float, float, int]] = []  # (sent at, answered at, status)
        self.readyz: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._requests, daemon=True) for _ in range(3)]
        self.threads.append(threading.Thread(target=self._readyz, daemon=True))

    def _requests(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    r = client.post(f"{self.c.gateway_url}/v1/encode/{BASE}", content=encode_body("x", 3000))
                    status = r.status_code
                except httpx.HTTPError:
                    status = 0
                    time.sleep(0.05)
                self.requests.append((time.monotonic(), status))
                self.started.append((sent, time.monotonic(), status))

    def _readyz(self) -> None:
        while not self.stop.is_set():
            self.readyz.append((time.monotonic(), self.c.readyz()[0]))
            time.sleep(0.05)

    def __enter__(self) -> Sampler:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def finish(self) -> None:
        """Stop sending and wait for every request in flight to be answered (a 3 s deadline each)."""
        self.stop.set()
        for t in self.threads:
            t.join(timeout=40)
        assert not any(t.is_alive() for t in self.threads), "a request was never answered"

    def since(self, t0: float) -> tuple[list[int], list[int]]:
        return [s for t, s in self.requests if t > t0], [s for t, s in self.readyz if t > t0]


def _recovered(sampler: Sampler, t0: float) -> bool:
    reqs, ready = sampler.since(t0)
    return len(reqs) > 5 and reqs[-5:] == [200] * 5 and bool(ready) and ready[-1] == 200


def _delete_the_work_stream(c: LocalCluster) -> None:
    async def delete() -> None:
        admin = await connect_as(c, "admin")
        await admin.jetstream().delete_stream(c.fleet.queue.stream)
        await admin.close()

    asyncio.run(delete())


def test_work_stream_deleted_under_load_heals(tmp_path: Path) -> None:
    """Every request is answered (the load is stopped and awaited before anything is checked): one sent once
    the stream is gone is served or refused at once (503), never left to time out. A task stored in the stream
    when it was deleted went with it, so only a request in flight at that moment may get 504 at its deadline
    (measured: sent 30 ms before the deletion returned, answered 504 after 3 s)."""
    with LocalCluster(synth_fleet(), workers=2, port=0, home=tmp_path / "home") as c, Sampler(c) as sampler:
        until(lambda: len(sampler.requests) > 20, 20, "load")
        t_del = time.monotonic()
        _delete_the_work_stream(c)
        t_gone = time.monotonic()
        took = until(lambda: _recovered(sampler, t_del), 30, "recovery after the stream was deleted")
        sampler.finish()  # every request in flight is answered before anything is checked
        after = [s for sent, _, s in sampler.started if sent > t_gone]
        caught = [s for sent, done, s in sampler.started if sent <= t_gone and done > t_del]
        print(f"\nstream deleted under load: recovered in {took:.2f}s; requests sent after the deletion "
              f"{counts_of(after)}, in flight at it {counts_of(caught)}")
        assert set(after) <= {200, 503}, counts_of(after)  # refused at once while broken, never left to time out
        assert set(caught) <= {200, 503, 504}, counts_of(caught)  # 504: its task was deleted with the stream
        log = c.log_path("worker-1").read_text() + c.log_path("worker-2").read_text()
        assert "re-created" in log and log.count("pull on") == 0  # healed, one line each, no warning per pull


# The race this retry tolerates: the probe is sampled, and the not-ready window can be shorter than one probe.
# Requests are refused 503 `no_worker` while both workers' heartbeats omit the base (their consumers are gone),
# and /readyz is not ready in exactly that state; but the window closes as soon as one worker re-creates its
# consumer and heartbeats, which can take less than a probe's round trip (seen: a 503 `no_worker` answer, then a
# /readyz call sent right after it answered ready). So a run can see a 503 and no not-ready sample. What does not
# depend on sampling (statuses, 504s, recovery) is checked without a retry by the test above.
@pytest.mark.flaky(reruns=1)
def test_readiness_says_not_ready_while_requests_are_refused(tmp_path: Path) -> None:
    with LocalCluster(synth_fleet(), workers=2, port=0, home=tmp_path / "home") as c, Sampler(c) as sampler:
        until(lambda: len(sampler.requests) > 20, 20, "load")
        t_del = time.monotonic()
        _delete_the_work_stream(c)
        until(lambda: _recovered(sampler, t_del), 30, "recovery after the stream was deleted")
        sampler.finish()
        reqs, ready = sampler.since(t_del)
        print(f"\nstream deleted under load: requests {counts_of(reqs)}, readyz {counts_of(ready)}")
        if 503 in reqs:  # if anything was refused, the probe said so too
            assert 503 in ready, counts_of(ready)


def test_memory_store_lost_with_its_server_heals(tmp_path: Path) -> None:
    with LocalCluster(synth_fleet(queue={"storage": "memory"}), workers=1, port=0, home=tmp_path / "home") as c:
        assert embed(c).status_code == 200
        assert c.nats is not None
        c.nats.restart()  # same port, memory store: the streams (and the fleet bucket) are gone
        took = until(lambda: c.readyz()[0] == 200 and embed(c, deadline_ms=3000).status_code == 200, 30,
                     "recovery after a memory-store restart")
        print(f"\nmemory store lost: serving again {took:.2f}s after nats-server came back")

        async def bucket() -> bool:  # admin's layout keeper made the fleet bucket again: `promote` works again
            admin = await connect_as(c, "admin")
            try:
                await admin.jetstream().key_value(FLEET_KV_BUCKET)
                return True
            except Exception:
                return False
            finally:
                await admin.close()

        until(lambda: asyncio.run(bucket()), 10, "the fleet bucket to be back")


def counts_of(statuses: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for s in statuses:
        out[s] = out.get(s, 0) + 1
    return dict(sorted(out.items()))


# ---- 3. supervision ------------------------------------------------------------------------------

def test_supervisor_restarts_killed_parts_and_status_sees_what_runs(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {**os.environ, "LORAFLEET_HOME": str(home)}
    c = LocalCluster(synth_fleet(), workers=2, port=0, home=home, supervise=True).start()
    try:
        old = {n: c.pid(n) for n in ("worker-1", "gateway")}
        c.kill("worker-1")
        c.kill("gateway")
        t0 = time.monotonic()
        until(lambda: ClusterState.load(home).restarts == {"worker-1": 1, "gateway": 1}, 20, "both restarted")
        c.wait_ready(timeout=60, workers=2)
        print(f"\nsupervisor: worker-1 and gateway killed, serving again after {time.monotonic() - t0:.2f}s")
        assert embed(c).status_code == 200
        status = json.loads(subprocess.run([sys.executable, "-m", "lorafleet.cli", "status", "--json"], env=env,
                                           capture_output=True, text=True, timeout=60, check=True).stdout)
        procs = status["processes"]
        for name in ("worker-1", "gateway"):
            assert procs[name]["alive"] and procs[name]["restarts"] == 1 and procs[name]["last_exit"] == -9
            assert procs[name]["pid"] == c.pid(name) != old[name]
        assert procs["worker-2"]["restarts"] == 0 and procs["nats-server"]["alive"]
        # A nats-server replaced by hand (new pid, not in any file) is still seen, and stopped by `down`.
        assert c.nats is not None
        c.nats.restart()
        replaced = c.nats.pid
        until(lambda: find_parts(home).get("nats-server") == replaced, 10, "the new nats-server found")
    finally:
        if c.supervisor is not None:
            c.supervisor.stop()  # `down` below plays the operator; the test process is no supervisor to stop
        stopped = down(home)
    assert {"nats-server", "gateway", "worker-1", "worker-2"} <= set(stopped)
    assert find_parts(home) == {}


# ---- 4. admission control ------------------------------------------------------------------------

def test_overload_is_shed_quickly_and_admitted_work_finishes_in_time(tmp_path: Path) -> None:
    """Twice the service rate: every request gets 200 or a quick 429; none that was admitted times out,
    and (almost) no computed answer is thrown away."""
    # One worker, batches of at most 4 costing 40 + 10·n ms: 50 tasks/s at full batches.
    fleet = synth_fleet(40.0, 10.0, max_items=4)
    capacity = 4 / 0.080
    deadline_ms = 2000
    with LocalCluster(fleet, workers=1, port=0, home=tmp_path / "home") as c:
        warm = Load(c, deadline_ms)  # the worker measures its rate (it starts unknown: everything is admitted)
        asyncio.run(warm.run(capacity * 0.8, 2.0))
        before = httpx.get(f"{c.gateway_url}/metrics").text
        load = Load(c, deadline_ms)
        outcomes = asyncio.run(load.run(2 * capacity, OVERLOAD_S))
        after = httpx.get(f"{c.gateway_url}/metrics").text

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    got = counts(outcomes)
    in_time = delta("lorafleet_gateway_batch_size_count", base=BASE)
    late = delta("lorafleet_gateway_dropped_results_total", reason="late")
    dup = delta("lorafleet_gateway_dropped_results_total", reason="duplicate")
    computed = in_time + late + dup
    thrown = (late + dup) / computed if computed else 0.0
    refused_ms = sorted(o.latency_ms for o in outcomes if o.status == 429)
    ok_ms = sorted(o.latency_ms for o in outcomes if o.status == 200)

    def p99(xs: list[float]) -> float:
        return xs[int(0.99 * (len(xs) - 1))] if xs else 0.0

    print(f"\noverload {2 * capacity:.0f} req/s (2x {capacity:.0f}/s) for {OVERLOAD_S:.0f}s, deadline "
          f"{deadline_ms} ms: statuses {got}; 200 p99 {p99(ok_ms):.0f} ms, 429 p99 {p99(refused_ms):.0f} ms; "
          f"computed {computed:.0f}, thrown away {late + dup:.0f} ({thrown:.2%})")
    assert set(got) <= {200, 429}, got  # no 504, no 503, no failed connection
    assert got.get(200, 0) > 0.3 * len(outcomes) and got.get(429, 0) > 0.2 * len(outcomes), got
    assert p99(refused_ms) < 250, "a 429 must come at once, not after waiting"
    assert p99(ok_ms) < deadline_ms
    assert thrown < 0.01


# ---- 5. orphans of a dead gateway ------------------------------------------------------------------

def test_a_dead_gateways_tasks_are_dropped_not_computed(tmp_path: Path) -> None:
    # A slow worker (batches of 8 take 60 ms: 133 tasks/s) and 400 queued tasks: most still wait when the gateway dies.
    fleet = synth_fleet(20.0, 5.0, max_items=8, worker={"orphan_grace_s": 1.0})
    with LocalCluster(fleet, workers=1, port=0, home=tmp_path / "home", supervise=True) as c:
        load = Load(c, 30_000)
        runner = threading.Thread(target=lambda: asyncio.run(load.run(2000.0, 0.2, drain_s=20)), daemon=True)
        runner.start()
        until(lambda: sum(o.status == 200 for o in load.outcomes) >= 20, 30, "the first answers")
        c.kill("gateway")  # its pending requests die with it; their tasks stay queued
        runner.join(timeout=60)
        answered = sum(o.status == 200 for o in load.outcomes)

        async def queue_state() -> tuple[int, int]:
            """(tasks waiting or unacked, tasks ever published into the work stream)"""
            admin = await connect_as(c, "admin")
            js = admin.jetstream()
            info = await js.consumer_info(c.fleet.queue.stream, consumer_name(BASE))
            published = (await js.stream_info(c.fleet.queue.stream)).state.last_seq
            await admin.close()
            return (info.num_pending or 0) + (info.num_ack_pending or 0), published

        until(lambda: asyncio.run(queue_state())[0] == 0, 60, "the orphans to leave the queue", poll_s=0.3)
        c.wait_ready(timeout=60)  # the supervisor brought a gateway back
        assert embed(c).status_code == 200
        answered += 1
        published = asyncio.run(queue_state())[1]
    computed, dropped = worker_totals(c.log_path("worker-1"))
    orphans = published - answered
    print(f"\ngateway killed with {orphans} of {published} published tasks unanswered: the worker computed "
          f"{computed} tasks for {answered} answered ones; {dropped} orphans dropped, "
          f"{dropped - (computed - answered)} of them never computed")
    # Every orphan leaves the queue dropped (a few after one computation: the batch in flight when the gateway
    # died, whose replies found nobody), none is computed again, and nothing else is dropped.
    assert dropped == orphans
    assert computed - answered <= 4 * 8, "orphans were computed for nobody"
