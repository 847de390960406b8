"""A real worker process against a real nats-server, with the tiny model and real LoRA adapters."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from sidecar_testkit import BASE, WorkerProcess, fleet_dict

from lorafleet.core.config import QueueConfig
from lorafleet.core.wire import (
    ERR_ADAPTER,
    ERR_DEADLINE,
    ERR_MALFORMED,
    HDR_DLQ_REASON,
    HDR_MSG_ID,
    Heartbeat,
    Result,
    Task,
    heartbeat_subject,
    inbox_prefix,
    pack,
    work_subject,
)
from lorafleet.nats.server import NatsServer
from lorafleet.testing import wait_until

pytestmark = pytest.mark.integration

QUEUE = QueueConfig()
TEXTS = [
    "Der Verkäufer einer Sache ist verpflichtet.",
    "Die Kündigung bedarf der Schriftform.",
    "The quick brown fox.",
    "Der Arbeitgeber hat dem Arbeitnehmer Urlaub zu gewähren, und zwar jedes Jahr aufs Neue.",
    "kurz",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
           tiny_adapters: dict[str, Path]) -> Iterator[tuple[NatsServer, WorkerProcess]]:
    tmp = tmp_path_factory.mktemp("served")
    server = NatsServer(tmp / "nats").start()
    fleet_file = tmp / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(fleet_dict(tiny_model_dir, tiny_adapters)))
    worker = WorkerProcess(fleet_file, server.url, "itest", tmp / "worker.log")
    try:
        worker.wait_ready()
        yield server, worker
    finally:
        rc = worker.stop()
        server.stop()
        assert rc == 0, worker.log()


@pytest.fixture(scope="module")
def direct(tiny_model_dir: Path, tiny_adapters: dict[str, Path]) -> Any:
    """Reference encoders: plain SentenceTransformer, and one per adapter loaded directly."""
    from sentence_transformers import SentenceTransformer

    def encode(texts: list[str], adapter: str | None) -> np.ndarray:
        model = SentenceTransformer(str(tiny_model_dir), device="cpu")
        if adapter is not None:
            model.load_adapter(str(tiny_adapters[adapter]))
        return model.encode(texts, convert_to_numpy=True)

    return encode


def make_task(text: str, reply: str, *, adapter: str | None = None, adapter_uri: str | None = None,
              deadline_s: float = 30.0, index: int = 0) -> Task:
    return Task(id=uuid.uuid4().hex, request_id="rq", index=index, model=adapter or BASE, base=BASE, text=text,
                tokens=len(text.split()) + 2, deadline=time.time() + deadline_s, reply=reply, adapter=adapter,
                adapter_uri=adapter_uri)


async def receive(nc: Any, sub: Any, timeout: float) -> Result:
    """Take one result off the inbox and confirm it, as the gateway does (workers ack after the receipt).

    An empty message is a worker's probe (is this task's gateway still here?): confirmed, not a result."""
    msg = await sub.next_msg(timeout=timeout)
    while True:
        if msg.reply:
            await nc.publish(msg.reply, b"")
        if msg.data:
            return Result.from_wire(msg.data)
        msg = await sub.next_msg(timeout=timeout)


async def roundtrip(url: str, tasks: list[Task], raw: list[bytes] = (), timeout: float = 20.0,
                    expect: int | None = None) -> list[Result]:
    """Publish tasks (and raw bodies) to the work stream, gather Results from the shared reply inbox."""
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()
    sub = await nc.subscribe(f"{inbox_prefix('itest-gw')}.>")
    for t in tasks:
        await js.publish(work_subject(BASE), t.to_wire(), headers={HDR_MSG_ID: t.id})
    for body in raw:
        await js.publish(work_subject(BASE), body, headers={HDR_MSG_ID: uuid.uuid4().hex})
    want = len(tasks) if expect is None else expect
    out: list[Result] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < want and time.monotonic() < deadline:
            try:
                out.append(await receive(nc, sub, 0.5))
            except TimeoutError:
                continue
    finally:
        await nc.close()
    return out


def reply_to() -> str:
    return f"{inbox_prefix('itest-gw')}.{uuid.uuid4().hex}"


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def by_text(tasks: list[Task], results: list[Result]) -> dict[str, Result]:
    ids = {t.id: t.text for t in tasks}
    return {ids[r.task_id]: r for r in results}


def test_base_results_equal_direct_encode(served: tuple[NatsServer, WorkerProcess], direct: Any) -> None:
    server, _ = served
    tasks = [make_task(t, reply_to(), index=i) for i, t in enumerate(TEXTS)]
    results = asyncio.run(roundtrip(server.url, tasks))
    assert len(results) == len(tasks)
    assert all(r.ok and r.worker == "itest" and r.batch_size >= 1 and r.queue_ms >= 0 for r in results), results
    got = by_text(tasks, results)
    vecs = np.stack([got[t].array() for t in TEXTS])
    assert vecs.shape == (len(TEXTS), got[TEXTS[0]].dim)
    assert cosines(vecs, direct(TEXTS, None)).min() > 0.9999
    assert [got[t.text].index for t in tasks] == list(range(len(tasks)))


def test_two_adapters_and_base_in_one_run(served: tuple[NatsServer, WorkerProcess], direct: Any,
                                         tiny_adapters: dict[str, Path]) -> None:
    server, _ = served
    tasks: list[Task] = []
    for text in TEXTS:  # interleaved, so one pull holds several (base, adapter) groups
        tasks.append(make_task(text, reply_to(), adapter="a"))  # URI from the fleet config (served model)
        tasks.append(make_task(text, reply_to(), adapter="b", adapter_uri=str(tiny_adapters["b"])))
        tasks.append(make_task(text, reply_to()))
    results = asyncio.run(roundtrip(server.url, tasks))
    assert len(results) == len(tasks) and all(r.ok for r in results), [r.error_message for r in results]
    vec = {r.task_id: r.array() for r in results}
    for adapter in ("a", "b", None):
        mine = [t for t in tasks if t.adapter == adapter]
        got = np.stack([vec[t.id] for t in mine])
        assert cosines(got, direct([t.text for t in mine], adapter)).min() > 0.9999, adapter
    a_vecs = np.stack([vec[t.id] for t in tasks if t.adapter == "a"])
    b_vecs = np.stack([vec[t.id] for t in tasks if t.adapter == "b"])
    assert cosines(a_vecs, b_vecs).max() < 0.999  # the adapters really differ, so the check above means something
    assert {r.worker for r in results} == {"itest"}
    hb = asyncio.run(next_heartbeat(server.url, "itest"))
    assert sorted(hb.adapters[BASE]) == ["a", "b"] and hb.bases == [BASE] and hb.tasks_done >= len(tasks)


async def next_heartbeat(url: str, worker_id: str) -> Heartbeat:
    import nats

    nc = await nats.connect(url)
    try:
        sub = await nc.subscribe(heartbeat_subject(worker_id))
        return Heartbeat.from_wire((await sub.next_msg(timeout=5)).data)
    finally:
        await nc.close()


async def dead_letters(url: str) -> list[Any]:
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(QUEUE.dlq_stream)
        return [await js.get_msg(QUEUE.dlq_stream, seq) for seq in range(info.state.first_seq, info.state.last_seq + 1)]
    finally:
        await nc.close()


def test_malformed_tasks_are_dead_lettered(served: tuple[NatsServer, WorkerProcess]) -> None:
    server, _ = served
    garbage = b"\xc1 not messagepack"
    reply = reply_to()
    missing_field = pack({"v": 1, "id": "bad-1", "i": 3, "r": reply, "b": BASE})  # readable reply, no text
    results = asyncio.run(roundtrip(server.url, [], raw=[garbage, missing_field], expect=1, timeout=10))
    assert len(results) == 1 and results[0].error_code == ERR_MALFORMED and results[0].task_id == "bad-1"
    assert results[0].index == 3

    def both_dead_lettered() -> dict[bytes, Any]:
        bodies = {m.data: m.headers for m in asyncio.run(dead_letters(server.url))}
        return bodies if garbage in bodies and missing_field in bodies else {}

    bodies = wait_until(both_dead_lettered, 10, "both malformed tasks in the dead-letter stream", poll_s=0.1)
    assert "MessagePack" in bodies[garbage][HDR_DLQ_REASON]
    assert "missing field" in bodies[missing_field][HDR_DLQ_REASON]


def test_expired_deadline_gets_deadline_error(served: tuple[NatsServer, WorkerProcess]) -> None:
    server, _ = served
    expired = make_task("zu spät", reply_to(), deadline_s=-1.0)
    fresh = make_task("rechtzeitig", reply_to())
    results = {r.task_id: r for r in asyncio.run(roundtrip(server.url, [expired, fresh]))}
    assert results[expired.id].error_code == ERR_DEADLINE and results[expired.id].vector is None
    assert results[fresh.id].ok


def test_missing_adapter_answers_and_dead_letters(served: tuple[NatsServer, WorkerProcess],
                                                  tiny_adapters: dict[str, Path]) -> None:
    server, _ = served
    ghost = tiny_adapters["a"].parent / "nowhere"  # under the worker's adapter root, but no adapter there
    task = make_task("ohne Adapter", reply_to(), adapter="ghost", adapter_uri=str(ghost))
    [result] = asyncio.run(roundtrip(server.url, [task]))
    assert result.error_code == ERR_ADAPTER and "no usable peft adapter" in (result.error_message or "")
    # The answer goes out before the task is dead-lettered: wait for the dead letter.
    wait_until(lambda: any(m.data == task.to_wire() for m in asyncio.run(dead_letters(server.url))), 10,
               "the task in the dead-letter stream", poll_s=0.1)


def test_adapter_paths_outside_the_roots_are_refused_alike(served: tuple[NatsServer, WorkerProcess],
                                                          tmp_path: Path) -> None:
    """A forged task cannot probe the worker's file system: an existing folder, an adapter outside the roots,
    a missing path, `..` and a foreign scheme all get the same answer, naming the URI only."""
    server, _ = served
    real = tmp_path / "elsewhere"
    real.mkdir()
    (real / "adapter_config.json").write_text("{}")
    uris = ["/etc", str(real), str(tmp_path / "missing"), "file:///etc/passwd", "../../../etc", "s3://bucket/x"]
    tasks = [make_task("x", reply_to(), adapter=f"probe-{i}", adapter_uri=u) for i, u in enumerate(uris)]
    results = {r.task_id: r for r in asyncio.run(roundtrip(server.url, tasks))}
    for task, uri in zip(tasks, uris, strict=True):
        message = results[task.id].error_message or ""
        assert results[task.id].error_code == ERR_ADAPTER
        assert message.replace(repr(uri), "URI") == (
            "adapter URI URI is not allowed on this worker: it loads adapters only from models:… references or "
            "folders under its adapter roots (worker.adapter_roots)"), message


def test_sigterm_drains_in_flight_and_exits_zero(nats_server: NatsServer, start_worker: Any,
                                                tiny_model_dir: Path, tiny_adapters: dict[str, Path]) -> None:
    worker = start_worker(fleet_dict(tiny_model_dir, tiny_adapters, profile={"max_batch_items": 8}),
                          nats_server.url, "drainer")
    tasks = [make_task(f"{TEXTS[i % len(TEXTS)]} {i}", reply_to(), index=i) for i in range(400)]
    asyncio.run(sigterm_midway(nats_server.url, tasks, worker))


async def sigterm_midway(url: str, tasks: list[Task], worker: WorkerProcess) -> None:
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()
    results = await nc.subscribe(f"{inbox_prefix('itest-gw')}.>")
    beats = await nc.subscribe(heartbeat_subject(worker.worker_id))
    await asyncio.gather(*(js.publish(work_subject(BASE), t.to_wire(), headers={HDR_MSG_ID: t.id}) for t in tasks))
    first = await receive(nc, results, 10)
    worker.terminate()
    answered = {first.task_id: first}
    while worker.proc.poll() is None or results.pending_msgs:
        try:
            r = await receive(nc, results, 0.2)
            answered[r.task_id] = r
        except TimeoutError:
            continue
    assert worker.proc.returncode == 0, worker.log()
    assert all(r.ok for r in answered.values())
    last_beats = []
    while beats.pending_msgs:
        last_beats.append(Heartbeat.from_wire((await beats.next_msg(timeout=1)).data))
    assert last_beats and last_beats[-1].draining and last_beats[-1].in_flight == 0
    info = {c.name: c for c in await js.consumers_info(QUEUE.stream)}
    consumer = info[f"workers-{BASE}"]
    # Every task was either answered and acked, or is still waiting in the queue: none in limbo, none lost.
    assert consumer.num_ack_pending == 0
    assert len(answered) + consumer.num_pending == len(tasks)
    assert 0 < len(answered) < len(tasks)  # it stopped pulling instead of finishing the whole queue
    await nc.close()


def test_one_worker_serves_two_bases_and_drains_both(nats_server: NatsServer, start_worker: Any,
                                                      tiny_model_dir: Path, tiny_adapters: dict[str, Path]) -> None:
    """One pull loop over two consumers: both bases answered; a SIGTERM leaves nothing in limbo on either."""
    fleet = fleet_dict(tiny_model_dir, tiny_adapters, profile={"max_batch_items": 4})
    fleet["bases"].append({"name": "tiny2", "source": str(tiny_model_dir)})
    worker = start_worker(fleet, nats_server.url, "twobases")
    asyncio.run(two_bases(nats_server.url, worker, lambda: start_worker(fleet, nats_server.url, "twobases-2")))


async def two_bases(url: str, worker: WorkerProcess, start_another: Any) -> None:
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()
    results = await nc.subscribe(f"{inbox_prefix('itest-gw')}.>")

    def task(base: str, i: int) -> Task:
        t = make_task(f"{TEXTS[i % len(TEXTS)]} {i}", reply_to(), index=i)
        t.base = base
        return t

    async def publish(tasks: list[Task]) -> None:
        await asyncio.gather(*(js.publish(work_subject(t.base), t.to_wire(), headers={HDR_MSG_ID: t.id})
                               for t in tasks))

    # Work on one base only, then the other only, then both: each is served.
    for bases in (["tiny2"], [BASE], [BASE, "tiny2"]):
        tasks = [task(b, i) for b in bases for i in range(6)]
        await publish(tasks)
        got = {}
        while len(got) < len(tasks):
            r = await receive(nc, results, 10)
            got[r.task_id] = r
        assert set(got) == {t.id for t in tasks} and all(r.ok and r.dim for r in got.values())
    # SIGTERM with both queues full: what was pulled is answered, the rest waits in the queue.
    tasks = [task(b, i) for i in range(150) for b in (BASE, "tiny2")]
    await publish(tasks)
    first = await receive(nc, results, 10)
    worker.terminate()
    answered = [first.task_id]
    while worker.proc.poll() is None or results.pending_msgs:
        try:
            answered.append((await receive(nc, results, 0.2)).task_id)
        except TimeoutError:
            continue
    assert worker.proc.returncode == 0, worker.log()
    assert 0 < len(answered) < len(tasks)  # it stopped pulling instead of finishing both queues
    # Tasks it held without computing went back (nak): a second worker answers everything left, once.
    await asyncio.get_running_loop().run_in_executor(None, start_another)
    deadline = time.monotonic() + 60
    while len(set(answered)) < len(tasks) and time.monotonic() < deadline:
        try:
            answered.append((await receive(nc, results, 0.5)).task_id)
        except TimeoutError:
            continue
    assert sorted(answered) == sorted(t.id for t in tasks)  # every task answered, none twice
    await nc.close()


def test_batch_time_budget_caps_what_a_worker_pulls(nats_server: NatsServer, start_worker: Any,
                                                    tiny_model_dir: Path, tiny_adapters: dict[str, Path]) -> None:
    """With max_batch_ms below one task's measured time, a worker pulls one task at a time once it has timed a batch.

    The tasks it does not pull stay in the shared queue, where a faster peer would take them.
    """
    worker = start_worker(fleet_dict(tiny_model_dir, tiny_adapters, profile={"max_batch_ms": 0.001}),
                          nats_server.url, "budgeted")
    tasks = [make_task(f"{TEXTS[i % len(TEXTS)]} {i}", reply_to(), index=i) for i in range(60)]
    results = asyncio.run(roundtrip(nats_server.url, tasks, timeout=60.0))
    assert len(results) == len(tasks) and all(r.ok and r.worker == worker.worker_id for r in results)
    sizes = [r.batch_size for r in results]
    # Only the batch pulled before any timing may exceed one task (at most the 32-item cap).
    assert sum(1 for s in sizes if s > 1) <= 32 and sizes.count(1) >= len(tasks) - 32, sorted(sizes)
