"""Authenticated, least-privilege NATS: each role against a real nats-server with the real layout.

Refusals are observed as the server's permissions-violation errors (nats-py's error callback), and
the state they would have changed is checked afterwards with the admin credential. A refused
JetStream API call gets no answer at all (the server drops the request), so the tests wait for the
violation, not for the call's timeout.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import stat
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    RePublish,
    StreamConfig,
    StreamSource,
    SubjectTransform,
)

from lorafleet.core.config import QueueConfig
from lorafleet.core.wire import (
    FLEET_KV_BUCKET,
    HDR_MSG_ID,
    HEARTBEAT_PREFIX,
    WORK_PREFIX,
    Result,
    consumer_name,
    dlq_subject,
    heartbeat_subject,
    work_subject,
)
from lorafleet.nats.auth import (
    ENV_CREDS,
    ENV_TLS_CA,
    PERMISSIONS,
    ROLES,
    CredentialsError,
    TlsFiles,
    add_credential,
    authorization_config,
    connect_options,
    explain_connect_error,
    gateway_inbox_prefix,
    generate_credentials,
    load_credentials,
    options_from_env,
    role_of,
)
from lorafleet.nats.queue import ensure_consumer, ensure_streams, work_stream_config
from lorafleet.nats.server import NatsServer
from lorafleet.nats.tls import issue_certificate, make_self_signed_ca
from lorafleet.testing import flush_nats

pytestmark = pytest.mark.integration

QUEUE = QueueConfig()
BASE = "mini-base"
KV_STREAM = f"KV_{FLEET_KV_BUCKET}"
WAIT_S = 10.0  # upper bound on any awaited event; each arrives in milliseconds


class Errors:
    """nats-py's async errors of one connection, awaitable by a fragment of their text."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._changed = asyncio.Condition()

    async def on_error(self, exc: Exception) -> None:  # nats-py wants a coroutine function
        async with self._changed:
            self.seen.append(str(exc))
            self._changed.notify_all()

    async def wait(self, *fragments: str) -> str:
        """The first error containing every fragment (case-insensitive), waiting for it if needed."""
        def match() -> str | None:
            return next((e for e in self.seen if all(f.lower() in e.lower() for f in fragments)), None)

        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: match() is not None), WAIT_S)
        found = match()
        assert found is not None
        return found

    def violations(self) -> list[str]:
        return [e for e in self.seen if "permissions violation" in e.lower()]


async def refused(errors: Errors, op: Awaitable[Any], *fragments: str) -> None:
    """`op` is refused by the server: a permissions violation naming `fragments` arrives, and the op
    never succeeds (a dropped request would only time out; it is cancelled once the refusal is seen)."""
    task = asyncio.ensure_future(op)
    seen = asyncio.ensure_future(errors.wait("permissions violation", *fragments))
    done, _ = await asyncio.wait([task, seen], timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
    if task in done and task.exception() is None:
        seen.cancel()
        raise AssertionError(f"expected a refusal naming {fragments}, but the call succeeded: {task.result()!r}")
    await seen
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def nothing_delivered(sub: Any, receiver: Client, sender: Client) -> None:
    """No message is waiting on `sub`: a sentinel from `sender` (admin: it may publish anywhere)
    reaches `receiver`'s private inbox. Messages from one connection reach a subscriber in order,
    so once the sentinel is in, anything `sender` published before it would have been too."""
    sentinel = receiver.new_inbox()  # under the receiver's private inbox prefix
    probe = await receiver.subscribe(sentinel)
    await flush_nats(receiver)  # nats-py's flush() alone may answer before the server has the SUB
    await sender.publish(sentinel, b"")
    await sender.flush()
    await probe.next_msg(timeout=WAIT_S)
    await probe.unsubscribe()
    assert sub.pending_msgs == 0, "a refused subscription still received messages"


@pytest.fixture
def creds_dir(tmp_path: Path) -> Path:
    # A second gateway credential, to show that one gateway cannot read or answer into another's inbox.
    generate_credentials(tmp_path / "creds", [*ROLES, "gateway-b"])
    return tmp_path / "creds"


@pytest.fixture
def server(tmp_path: Path, creds_dir: Path) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path / "nats", creds=creds_dir).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
async def connect(server: NatsServer) -> AsyncIterator[Any]:
    """connect(name) → (client, its Errors); every client is closed at the end."""
    clients: list[Client] = []

    async def _connect(name: str, **extra: Any) -> tuple[Client, Errors]:
        errors = Errors()
        nc = await nats.connect(server.url, **server.client_options(name), error_cb=errors.on_error,
                                name=f"test-{name}", allow_reconnect=False, **extra)
        clients.append(nc)
        return nc, errors

    yield _connect
    for nc in clients:
        if not nc.is_closed:
            await nc.close()


@pytest.fixture
async def layout(connect: Any) -> Client:
    """The cluster as `lorafleet up` leaves it: streams and fleet bucket made by admin, one promoted entry."""
    admin, _ = await connect("admin")
    js = admin.jetstream()
    await ensure_streams(js, QUEUE)
    kv = await js.create_key_value(KeyValueConfig(bucket=FLEET_KV_BUCKET, history=16))
    await kv.put("german-legal", b'{"name": "german-legal"}')
    return admin


# ---- credentials -----------------------------------------------------------------------------------

def test_credential_files_are_private_kept_and_never_in_the_config(tmp_path: Path) -> None:
    d = tmp_path / "home" / "creds"
    first = generate_credentials(d)
    assert set(first.by_name) == set(ROLES)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for c in first.by_name.values():
        assert stat.S_IMODE(c.path.stat().st_mode) == 0o600
        assert c.path.read_text().startswith("SU") and c.public_key.startswith("U")
    again = generate_credentials(d)  # idempotent: running `lorafleet up` twice keeps every key
    assert {n: c.public_key for n, c in again.by_name.items()} == {n: c.public_key for n, c in first.by_name.items()}

    config = authorization_config(again)
    seeds = [c.path.read_text().strip() for c in again.by_name.values()]
    assert all(seed not in config and seed not in repr(c) for seed, c in zip(seeds, again.by_name.values(),
                                                                              strict=True))
    assert all(c.public_key in config for c in again.by_name.values())

    assert role_of("worker-gpu3") == "worker"
    with pytest.raises(CredentialsError, match="must be a role"):
        role_of("root")
    assert add_credential(d, "worker-gpu3").role == "worker"
    assert "worker-gpu3" in load_credentials(d).by_name


def test_options_from_env_carry_paths_not_secrets(creds_dir: Path, tmp_path: Path) -> None:
    ca = make_self_signed_ca(tmp_path / "tls")
    worker = creds_dir / "worker.nk"
    opts = options_from_env({ENV_CREDS: str(worker), ENV_TLS_CA: str(ca.cert)})
    assert opts["nkeys_seed"] == str(worker)
    assert opts["inbox_prefix"].startswith("_LF_INBOX.U")
    assert opts["tls"] is not None
    assert worker.read_text().strip() not in repr(opts)
    assert options_from_env({}) == {}  # no credentials: a server without auth (`--insecure-no-auth`)


# ---- authentication -------------------------------------------------------------------------------

async def test_without_credentials_a_client_cannot_connect(server: NatsServer, tmp_path: Path) -> None:
    with pytest.raises(nats.errors.Error) as anonymous:
        await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    message = explain_connect_error(anonymous.value, server.url)
    assert "requires credentials" in message and ENV_CREDS in message

    # A well-formed key the server does not list is refused the same way.
    stranger = add_credential(tmp_path / "elsewhere", "admin")
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(server.url, nkeys_seed=str(stranger.path), allow_reconnect=False,
                           max_reconnect_attempts=0, connect_timeout=2)


async def test_a_deleted_credential_is_revoked_on_reload(server: NatsServer, creds_dir: Path, tmp_path: Path,
                                                         connect: Any) -> None:
    remote = add_credential(creds_dir, "worker-gpu3")
    server.reload()
    copy = tmp_path / "remote-host" / "worker.nk"  # what the remote worker keeps
    copy.parent.mkdir()
    shutil.copy2(remote.path, copy)

    errors, lost = Errors(), asyncio.Event()

    async def on_disconnect() -> None:
        lost.set()

    nc = await nats.connect(server.url, nkeys_seed=str(copy), inbox_prefix=f"_LF_INBOX.{remote.public_key}",
                            error_cb=errors.on_error, disconnected_cb=on_disconnect, max_reconnect_attempts=1,
                            reconnect_time_wait=0.05)
    try:
        await nc.jetstream().account_info()  # admitted, with the worker's permissions
        remote.path.unlink()
        server.reload()
        await asyncio.wait_for(lost.wait(), WAIT_S)
        await errors.wait("authorization violation")  # the reconnect with the revoked key is refused
    finally:
        await nc.close()


# ---- worker ---------------------------------------------------------------------------------------

async def test_worker_can_do_everything_a_worker_does(server: NatsServer, layout: Client, connect: Any) -> None:
    gateway, gw_errors = await connect("gateway")
    worker, w_errors = await connect("worker")
    js = worker.jetstream()

    # The gateway side: its own result inbox answers receipts; it watches heartbeats.
    inbox = gateway_inbox_prefix("gw-1", server.creds("gateway"))
    results: asyncio.Queue[Result] = asyncio.Queue()

    async def on_result(msg: Any) -> None:
        await gateway.publish(msg.reply, b"")  # the receipt, through allow_responses
        await results.put(Result.from_wire(msg.data))

    await gateway.subscribe(f"{inbox}.>", cb=on_result)
    heartbeats = await gateway.subscribe(f"{HEARTBEAT_PREFIX}.>")
    await flush_nats(gateway)  # the server has both subscriptions before anyone publishes

    # Worker start-up: streams exist (info only), create/bind its durable consumer, watch the fleet bucket.
    await js.stream_info(QUEUE.stream)
    assert await ensure_consumer(js, BASE, QUEUE) == consumer_name(BASE)
    psub = await js.pull_subscribe_bind(durable=consumer_name(BASE), stream=QUEUE.stream)
    kv = await js.key_value(FLEET_KV_BUCKET)
    watch = await kv.watchall()
    assert (await watch.updates(timeout=WAIT_S)).key == "german-legal"

    # One task: the gateway publishes it (JetStream ack), the worker pulls, keeps it alive, answers, acks.
    ack = await gateway.jetstream().publish(work_subject(BASE), b"task-1", headers={HDR_MSG_ID: "t1"})
    assert ack.stream == QUEUE.stream
    [msg] = await psub.fetch(1, timeout=WAIT_S)
    await msg.in_progress()
    receipt = await worker.request(f"{inbox}.req-1", Result("t1", 0, "w1", vector=b"\0" * 8, dim=2).to_wire(),
                                   timeout=WAIT_S)
    assert receipt.data == b""
    assert (await results.get()).task_id == "t1"
    await msg.ack_sync()

    # A second task is nak'ed, then terminated and dead-lettered.
    await gateway.jetstream().publish(work_subject(BASE), b"task-2", headers={HDR_MSG_ID: "t2"})
    [msg] = await psub.fetch(1, timeout=WAIT_S)
    await msg.nak()
    [msg] = await psub.fetch(1, timeout=WAIT_S)
    await msg.term()
    dlq_ack = await js.publish(dlq_subject(BASE), msg.data, headers={HDR_MSG_ID: "dlq-t2"}, stream=QUEUE.dlq_stream)
    assert dlq_ack.stream == QUEUE.dlq_stream

    await worker.publish(heartbeat_subject("w1"), b"hb")
    assert (await heartbeats.next_msg(timeout=WAIT_S)).data == b"hb"

    # The fleet bucket changes (control's job) reach the worker's watch.
    control, _ = await connect("control")
    await (await control.jetstream().key_value(FLEET_KV_BUCKET)).put("german-legal", b'{"v": 2}')
    update = await watch.updates(timeout=WAIT_S)
    while update is None:  # the end-of-initial-values marker
        update = await watch.updates(timeout=WAIT_S)
    assert update.value == b'{"v": 2}'
    await watch.stop()

    assert w_errors.violations() == [] and gw_errors.violations() == []


async def test_worker_is_refused_everything_else(server: NatsServer, layout: Client, connect: Any) -> None:
    worker, errors = await connect("worker")
    js = worker.jetstream()
    admin = layout

    everything = await worker.subscribe(">")
    await errors.wait("permissions violation", "subscription", '">"')
    await admin.publish(f"{HEARTBEAT_PREFIX}.w9", b"secret")
    await admin.publish(gateway_inbox_prefix("gw-1", server.creds("gateway")) + ".r1", b"someone's vector")
    await nothing_delivered(everything, worker, admin)

    gw_inbox = gateway_inbox_prefix("gw-1", server.creds("gateway"))
    await worker.subscribe(f"{gw_inbox}.>")
    await errors.wait("permissions violation", "subscription", gw_inbox)
    await worker.subscribe("_INBOX.>")
    await errors.wait("permissions violation", "subscription", '"_INBOX.>"')
    await worker.subscribe(f"{WORK_PREFIX}.>")  # reading tasks goes through its consumer only
    await errors.wait("permissions violation", "subscription", WORK_PREFIX)

    kv = await js.key_value(FLEET_KV_BUCKET)  # reading is allowed
    await refused(errors, kv.put("german-legal", b"forged"), f"$KV.{FLEET_KV_BUCKET}.german-legal")
    await refused(errors, kv.delete("german-legal"), f"$KV.{FLEET_KV_BUCKET}.german-legal")
    await refused(errors, js.delete_stream(QUEUE.stream), f"STREAM.DELETE.{QUEUE.stream}")
    await refused(errors, js.purge_stream(QUEUE.stream), f"STREAM.PURGE.{QUEUE.stream}")
    await refused(errors, js.update_stream(work_stream_config(QUEUE)), f"STREAM.UPDATE.{QUEUE.stream}")
    await refused(errors, js.delete_key_value(FLEET_KV_BUCKET), f"STREAM.DELETE.{KV_STREAM}")
    await refused(errors, js.add_stream(name="STOLEN", subjects=["lorafleet.>"]), "STREAM.CREATE.STOLEN")

    # Nothing changed.
    ajs = admin.jetstream()
    assert (await ajs.stream_info(QUEUE.stream)).config.max_msgs == QUEUE.max_msgs
    assert (await (await ajs.key_value(FLEET_KV_BUCKET)).get("german-legal")).value == b'{"name": "german-legal"}'


async def test_the_fleet_watcher_runs_on_reader_credentials(server: NatsServer, layout: Client,
                                                           connect: Any) -> None:
    """Gateways and workers watch promotions with FleetWatcher, control writes them with put_entry."""
    from lorafleet.core.fleet_state import FleetEntry, FleetWatcher, open_fleet_bucket, put_entry

    control, c_errors = await connect("control")
    entry = FleetEntry(name="german-legal", base=BASE, adapter_id="german-legal@v2", adapter_uri="/adapters/gl",
                       version="2", registered_model="german-legal", action="promote")
    for role in ("worker", "gateway"):
        nc, errors = await connect(role)
        tables: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        watcher = FleetWatcher(nc.jetstream(), tables.put_nowait)
        await watcher.start()
        await watcher.wait_initialised()
        await put_entry(await open_fleet_bucket(control.jetstream()), entry.model_copy(update={"version": role}))
        table = await asyncio.wait_for(tables.get(), WAIT_S)
        while table.get("german-legal") is None or table["german-legal"].version != role:
            table = await asyncio.wait_for(tables.get(), WAIT_S)
        await watcher.stop()
        assert errors.violations() == []
    assert c_errors.violations() == []


# ---- gateway --------------------------------------------------------------------------------------

async def test_gateway_publishes_work_and_cannot_answer_read_or_destroy(server: NatsServer, layout: Client,
                                                                        connect: Any) -> None:
    gateway, errors = await connect("gateway")
    other, _ = await connect("gateway-b")
    js = gateway.jetstream()

    # Allowed: publish work (JetStream ack), own result inbox, heartbeats, read the queue and the bucket.
    ack = await js.publish(work_subject(BASE), b"task", headers={HDR_MSG_ID: uuid.uuid4().hex})
    assert ack.stream == QUEUE.stream and not ack.duplicate
    own = gateway_inbox_prefix("gw-a", server.creds("gateway"))
    mine = await gateway.subscribe(f"{own}.>")
    await gateway.subscribe(f"{HEARTBEAT_PREFIX}.>")
    assert (await js.stream_info(QUEUE.stream)).state.messages == 1
    await js.consumers_info(QUEUE.stream)
    watch = await (await js.key_value(FLEET_KV_BUCKET)).watchall()
    assert (await watch.updates(timeout=WAIT_S)).key == "german-legal"
    await watch.stop()

    # Another gateway's inbox: neither readable nor writable; any `_INBOX` subject is closed to publishing,
    # so a gateway credential cannot answer a task.
    theirs = gateway_inbox_prefix("gw-b", server.creds("gateway-b"))
    b_results = await other.subscribe(f"{theirs}.>")
    await flush_nats(other)
    stolen = await gateway.subscribe(f"{theirs}.>")
    await errors.wait("permissions violation", "subscription", theirs)
    await layout.publish(f"{theirs}.r1", b"b's result")  # as a worker would
    await nothing_delivered(stolen, gateway, layout)
    assert (await b_results.next_msg(timeout=WAIT_S)).data == b"b's result"
    await gateway.publish(f"{theirs}.r1", b"forged")
    await errors.wait("permissions violation", "publish", theirs)
    await nothing_delivered(b_results, other, layout)
    await gateway.publish(f"{own}.r1", b"forged to itself")  # not even its own inbox: results come from workers
    await errors.wait("permissions violation", "publish", f"{own}.r1")
    await nothing_delivered(mine, gateway, layout)

    # Not the fleet bucket, not the streams.
    kv = await js.key_value(FLEET_KV_BUCKET)
    await refused(errors, kv.put("german-legal", b"forged"), f"$KV.{FLEET_KV_BUCKET}")
    await refused(errors, js.delete_stream(QUEUE.stream), f"STREAM.DELETE.{QUEUE.stream}")
    await refused(errors, js.purge_stream(QUEUE.stream), f"STREAM.PURGE.{QUEUE.stream}")
    await refused(errors, js.delete_consumer(QUEUE.stream, consumer_name(BASE)), "CONSUMER.DELETE")
    assert (await layout.jetstream().stream_info(QUEUE.stream)).state.messages == 1

    # It may take back a task it published (a request the stream refused part of), one message by sequence.
    assert await js.delete_msg(ack.stream, ack.seq)
    assert (await layout.jetstream().stream_info(QUEUE.stream)).state.messages == 0


async def test_gateways_and_workers_cannot_create_streams_they_wait_for_them(server: NatsServer, connect: Any) -> None:
    from lorafleet.nats.queue import stream_exists, wait_for_stream

    admin, _ = await connect("admin")
    for role in ("gateway", "worker"):
        nc, errors = await connect(role)
        js = nc.jetstream()
        assert not await stream_exists(js, QUEUE.stream)
        await refused(errors, js.add_stream(work_stream_config(QUEUE, [BASE])), f"STREAM.CREATE.{QUEUE.stream}")
        await refused(errors, js.create_key_value(KeyValueConfig(bucket=FLEET_KV_BUCKET)), f"STREAM.CREATE.{KV_STREAM}")
        waiting = asyncio.create_task(wait_for_stream(js, QUEUE.stream, poll_s=0.05))
        assert await ensure_streams(admin.jetstream(), QUEUE, bases=[BASE], max_age_s=40.0, update=True)
        await asyncio.wait_for(waiting, WAIT_S)
        if role == "worker":
            assert await ensure_consumer(js, BASE, QUEUE) == consumer_name(BASE)
        await admin.jetstream().delete_stream(QUEUE.stream)
        await admin.jetstream().delete_stream(QUEUE.dlq_stream)
    assert await ensure_streams(admin.jetstream(), QUEUE, bases=[BASE], max_age_s=40.0, update=True)
    info = await admin.jetstream().stream_info(QUEUE.stream)
    # Only the served bases' subjects, each bounded on its own, and nothing older than the largest deadline.
    assert info.config.subjects == [work_subject(BASE)] and info.config.max_age == 40.0
    assert info.config.duplicate_window == 40.0  # JetStream wants it within the max age
    assert info.config.max_msgs_per_subject == QUEUE.max_msgs and info.config.discard_new_per_subject


# ---- side doors into the fleet file (issue 38) -----------------------------------------------------

NON_ADMIN = ("gateway", "worker", "control", "worker-gpu3")  # worker-gpu3: a remote worker's `creds add`


def _reaching_the_fleet_file(name: str, subject: str) -> list[StreamConfig]:
    """Stream configs named `name` that reach the fleet file's bucket: a RePublish into its key (stored there, as
    a probe showed before the fix), a Source of it transformed onto that key, a Mirror of it."""
    from lorafleet.core.fleet_state import FLEET_CONFIG_KEY
    from lorafleet.core.wire import FLEET_CONFIG_KV_BUCKET

    key = f"$KV.{FLEET_CONFIG_KV_BUCKET}.{FLEET_CONFIG_KEY}"
    config_stream = f"KV_{FLEET_CONFIG_KV_BUCKET}"
    return [
        StreamConfig(name=name, subjects=[subject], republish=RePublish(src=subject, dest=key)),
        StreamConfig(name=name, subjects=[subject], sources=[StreamSource(
            name=config_stream, subject_transforms=[SubjectTransform(src=key, dest=key)])]),
        StreamConfig(name=name, mirror=StreamSource(name=config_stream)),
    ]


async def test_only_admin_creates_or_changes_a_stream_whatever_its_config(server: NatsServer, creds_dir: Path,
                                                                          connect: Any) -> None:
    """NATS permissions name a stream, never its config, and a stream's creator chooses the config: a gateway that
    could create a lost work stream could give it a RePublish into the fleet file workers trust. So no role but
    admin may create or update any stream, missing or present; admin (`lorafleet up`) still may."""
    from lorafleet.core.config import BaseModelSpec, FleetConfig
    from lorafleet.core.fleet_state import FLEET_CONFIG_KEY
    from lorafleet.core.wire import FLEET_CONFIG_KV_BUCKET
    from lorafleet.ops.cluster import apply_layout

    add_credential(creds_dir, "worker-gpu3")
    server.reload()
    fleet = FleetConfig(bases=[BaseModelSpec(name=BASE)])
    await apply_layout(server.url, server.client_options("admin"), fleet)
    admin, _ = await connect("admin")
    ajs = admin.jetstream()
    config_kv = await ajs.key_value(FLEET_CONFIG_KV_BUCKET)
    original = (await config_kv.get(FLEET_CONFIG_KEY)).value
    streams = {QUEUE.stream: work_subject(BASE), QUEUE.dlq_stream: dlq_subject(BASE),
               KV_STREAM: f"$KV.{FLEET_KV_BUCKET}.x", "STOLEN": "stolen.x"}
    lost = (QUEUE.stream, QUEUE.dlq_stream, KV_STREAM)
    for role in NON_ADMIN:
        nc, errors = await connect(role)
        js = nc.jetstream()
        for name in lost:  # present: reconfiguring them is refused
            for config in _reaching_the_fleet_file(name, streams[name]):
                await refused(errors, js.update_stream(config), f"STREAM.UPDATE.{name}")
        for name in lost:  # lost, as a memory store after a restart: creating them is refused too
            await ajs.delete_stream(name)
        for name, subject in streams.items():
            for config in _reaching_the_fleet_file(name, subject):
                await refused(errors, js.add_stream(config), f"STREAM.CREATE.{name}")
        assert {s.config.name for s in await ajs.streams_info()} == {f"KV_{FLEET_CONFIG_KV_BUCKET}"}, role
        await apply_layout(server.url, server.client_options("admin"), fleet)
    # Admin may: a stream that republishes onto the fleet file's key. Even so the fleet file stays as admin wrote
    # it: its bucket is sealed, so nothing sent there is stored.
    republishing = _reaching_the_fleet_file("STOLEN", "stolen.x")[0]
    assert (await ajs.add_stream(republishing)).config.republish is not None
    await ajs.publish("stolen.x", b'{"bases": [{"name": "forged"}]}')
    entry = await config_kv.get(FLEET_CONFIG_KEY)
    assert entry.value == original
    assert entry.revision == (await ajs.stream_info(f"KV_{FLEET_CONFIG_KV_BUCKET}")).state.last_seq


async def test_no_answer_or_delivery_reaches_the_fleet_file(server: NatsServer, creds_dir: Path,
                                                            connect: Any) -> None:
    """Every client names its reply subjects, and publish permissions do not cover them: a JetStream API request
    with the reply `$KV.<config bucket>._fleet` had the server store its answer as the fleet file (before the
    bucket was sealed). Nor may a consumer any role may create (a KV watch's, a worker's) deliver into it."""
    from lorafleet.core.config import BaseModelSpec, FleetConfig
    from lorafleet.core.fleet_state import FLEET_CONFIG_KEY, fetch_fleet_config
    from lorafleet.core.wire import FLEET_CONFIG_KV_BUCKET
    from lorafleet.ops.cluster import apply_layout

    add_credential(creds_dir, "worker-gpu3")
    server.reload()
    fleet = FleetConfig(bases=[BaseModelSpec(name=BASE)])
    await apply_layout(server.url, server.client_options("admin"), fleet)
    admin, _ = await connect("admin")
    config_stream = f"KV_{FLEET_CONFIG_KV_BUCKET}"
    key = f"$KV.{FLEET_CONFIG_KV_BUCKET}.{FLEET_CONFIG_KEY}"
    before = await admin.jetstream().stream_info(config_stream)
    fleet_kv = await admin.jetstream().key_value(FLEET_KV_BUCKET)
    await fleet_kv.put("german-legal", b'{"bases": [{"name": "forged"}]}')  # what control may write
    # Admin listens on the key, as anyone with the right might: that interest also lets a push consumer deliver.
    sent_there = await admin.subscribe(key)
    await flush_nats(admin)
    for role in NON_ADMIN:
        nc, errors = await connect(role)
        for request in (f"$JS.API.STREAM.INFO.{KV_STREAM}", "$JS.API.INFO"):  # two answers
            await nc.publish(request, b"", reply=key)
        await nc.publish(f"$JS.API.DIRECT.GET.{KV_STREAM}", b'{"last_by_subj": "$KV.%s.german-legal"}'
                         % FLEET_KV_BUCKET.encode(), reply=key)  # none: the bucket serves no direct gets
        push = ConsumerConfig(deliver_subject=key, filter_subject=f"$KV.{FLEET_KV_BUCKET}.german-legal",
                              deliver_policy=DeliverPolicy.LAST, ack_policy=AckPolicy.NONE)
        await nc.jetstream().add_consumer(KV_STREAM, push)  # allowed (a KV watch is one): one delivery
        for _ in range(3):  # the server has sent all three to the key
            await sent_there.next_msg(timeout=WAIT_S)
        assert errors.violations() == [], role
    stored = (await admin.jetstream().stream_info(config_stream)).state.last_seq - before.state.last_seq
    assert stored == 0, f"{stored} answers or deliveries were stored as the fleet file"
    got = await asyncio.to_thread(fetch_fleet_config, server.url, server.client_options("worker-gpu3"))
    assert [b.name for b in got.bases] == [BASE]


def test_client_settings_flag_beats_environment_beats_fleet_file(tmp_path: Path, creds_dir: Path) -> None:
    from lorafleet.core.config import NatsClientConfig
    from lorafleet.nats.client import ClientSettings

    config = NatsClientConfig(creds=str(creds_dir / "control.nk"), tls_ca="/from/file/ca.pem")
    env = {ENV_CREDS: str(creds_dir / "gateway.nk")}
    assert ClientSettings.resolve(config=config, environ={}).creds == creds_dir / "control.nk"
    got = ClientSettings.resolve(config=config, environ=env)
    assert got.creds == creds_dir / "gateway.nk" and got.tls is not None and str(got.tls.ca) == "/from/file/ca.pem"
    assert ClientSettings.resolve(creds=creds_dir / "worker.nk", config=config, environ=env).creds == \
        creds_dir / "worker.nk"
    fallback = ClientSettings.resolve(environ={}, fallback_creds=creds_dir / "control.nk")
    assert fallback.creds == creds_dir / "control.nk" and fallback.tls is None
    assert ClientSettings.resolve(environ={}, fallback_creds=tmp_path / "missing.nk").creds is None
    assert got.env() == {ENV_CREDS: str(creds_dir / "gateway.nk"), ENV_TLS_CA: "/from/file/ca.pem"}


async def test_forged_answers_fail_without_the_worker_role(server: NatsServer, layout: Client, connect: Any) -> None:
    gateway, _ = await connect("gateway")
    worker, _ = await connect("worker")
    inbox = gateway_inbox_prefix("gw-1", server.creds("gateway"))
    answers = await gateway.subscribe(f"{inbox}.>")
    await flush_nats(gateway)
    await ensure_consumer(worker.jetstream(), BASE, QUEUE)

    for role in ("gateway-b", "control"):
        attacker, errors = await connect(role)
        # See the task to answer it first: neither the work subjects nor the gateways' inboxes can be read …
        await attacker.subscribe(f"{WORK_PREFIX}.>")
        await errors.wait("permissions violation", "subscription", WORK_PREFIX)
        await attacker.subscribe("_INBOX.>")
        await errors.wait("permissions violation", "subscription", '"_INBOX.>"')
        # … nor pulled from the workers' consumer …
        ajs = attacker.jetstream()
        await refused(errors, _fetch_one(ajs), "CONSUMER.MSG.NEXT")
        # … and a guessed reply subject cannot be published to.
        await attacker.publish(f"{inbox}.req-1", Result("t1", 0, "evil", vector=b"\1" * 8, dim=2).to_wire())
        await errors.wait("permissions violation", "publish", inbox)

    # The task is still there for the worker, whose answer is the only one the gateway gets.
    await gateway.jetstream().publish(work_subject(BASE), b"task", headers={HDR_MSG_ID: "t1"})
    psub = await worker.jetstream().pull_subscribe_bind(durable=consumer_name(BASE), stream=QUEUE.stream)
    [msg] = await psub.fetch(1, timeout=WAIT_S)
    await worker.publish(f"{inbox}.req-1", Result("t1", 0, "w1", vector=b"\0" * 8, dim=2).to_wire())
    await msg.ack_sync()
    assert Result.from_wire((await answers.next_msg(timeout=WAIT_S)).data).worker == "w1"
    await nothing_delivered(answers, gateway, layout)  # no forged answer came before or after it


async def _fetch_one(js: Any) -> Any:
    psub = await js.pull_subscribe_bind(durable=consumer_name(BASE), stream=QUEUE.stream)
    return await psub.fetch(1, timeout=WAIT_S)


# ---- control and admin ----------------------------------------------------------------------------

async def test_control_writes_the_fleet_bucket_only_admin_deletes(server: NatsServer, layout: Client,
                                                                  connect: Any) -> None:
    control, errors = await connect("control")
    js = control.jetstream()
    kv = await js.key_value(FLEET_KV_BUCKET)
    await kv.put("german-legal", b'{"v": 3}')
    await kv.put("french-legal", b'{"v": 1}')
    await kv.delete("french-legal")
    assert (await kv.get("german-legal")).value == b'{"v": 3}'
    assert await kv.keys() == ["german-legal"]  # `lorafleet status` / promote read the table this way
    heartbeats = await control.subscribe(f"{HEARTBEAT_PREFIX}.>")  # `lorafleet status` reads these
    await flush_nats(control)  # the server has the subscription before anyone publishes
    await layout.publish(heartbeat_subject("w1"), b"hb")
    assert (await heartbeats.next_msg(timeout=WAIT_S)).data == b"hb"
    assert (await js.stream_info(QUEUE.stream)).config.name == QUEUE.stream
    await js.consumers_info(QUEUE.stream)

    await refused(errors, js.delete_key_value(FLEET_KV_BUCKET), f"STREAM.DELETE.{KV_STREAM}")
    await refused(errors, js.purge_stream(KV_STREAM), f"STREAM.PURGE.{KV_STREAM}")
    await refused(errors, js.delete_stream(QUEUE.stream), f"STREAM.DELETE.{QUEUE.stream}")
    await refused(errors, js.publish(work_subject(BASE), b"task"), WORK_PREFIX)

    admin = layout.jetstream()
    assert await admin.delete_stream(QUEUE.stream)
    assert await admin.delete_key_value(FLEET_KV_BUCKET)
    assert errors.violations()  # sanity: the refusals above were real


async def test_control_cannot_rewrite_the_fleet_file_workers_trust(server: NatsServer, connect: Any) -> None:
    """The fleet file in NATS names what a joining worker executes (a runtime's venv, `vllm serve` flags): only
    admin (`lorafleet up`) writes it. Control, which `promote` and a CI job hold, may not, in any bucket."""
    from lorafleet.core.config import BaseModelSpec, FleetConfig
    from lorafleet.core.fleet_state import FLEET_CONFIG_KEY, fetch_fleet_config
    from lorafleet.core.wire import FLEET_CONFIG_KV_BUCKET
    from lorafleet.ops.cluster import apply_layout

    fleet = FleetConfig(bases=[BaseModelSpec(name=BASE)])
    await apply_layout(server.url, server.client_options("admin"), fleet)  # what `lorafleet up` publishes
    control, errors = await connect("control")
    js = control.jetstream()
    forged = b'{"bases": [{"name": "x", "runtime": "vllm", "options": {"venv": "/tmp/evil"}}]}'
    await refused(errors, (await js.key_value(FLEET_KV_BUCKET)).put(FLEET_CONFIG_KEY, forged),
                  f"$KV.{FLEET_KV_BUCKET}.{FLEET_CONFIG_KEY}")
    await refused(errors, js.publish(f"$KV.{FLEET_CONFIG_KV_BUCKET}.{FLEET_CONFIG_KEY}", forged),  # a kv.put
                  f"$KV.{FLEET_CONFIG_KV_BUCKET}.{FLEET_CONFIG_KEY}")
    # Nor may it make a bucket of its own choosing: a stream's creator chooses where it republishes.
    await refused(errors, js.add_stream(name=KV_STREAM, subjects=[f"$KV.{FLEET_KV_BUCKET}.>"]),
                  f"STREAM.CREATE.{KV_STREAM}")
    # Promote's own writes still go through: served names, staged preloads, its lock.
    kv = await js.key_value(FLEET_KV_BUCKET)
    for key in ("german-legal", "_preload.german-legal", "_lock.german-legal"):
        await kv.put(key, b"{}")
    # Workers and gateways joining with only a URL and their credential read admin's file.
    for role in ("worker", "gateway"):
        got = await asyncio.to_thread(fetch_fleet_config, server.url, server.client_options(role))
        assert [b.name for b in got.bases] == [BASE] and not got.bases[0].options, role


def test_the_permission_table_keeps_destruction_for_admin() -> None:
    # The one deletion outside admin: a gateway takes back single tasks of a request the stream refused part of.
    take_back = {"gateway": "$JS.API.STREAM.MSG.DELETE.{work}"}
    for role, perms in PERMISSIONS.items():
        if role == "admin":
            continue
        for subject in perms.publish:
            if subject == take_back.get(role):
                continue
            # No STREAM.CREATE either: its config could republish anywhere (issue 38); admin's keeper heals.
            assert not any(verb in subject for verb in ("DELETE", "PURGE", "UPDATE", "SNAPSHOT", "RESTORE",
                                                        "STREAM.CREATE")), subject
            assert subject not in (">", "$JS.API.>", "$JS.>", "$KV.>"), subject
        assert ">" not in perms.subscribe and "_INBOX.>" not in perms.subscribe


# ---- TLS ------------------------------------------------------------------------------------------

@pytest.fixture
def tls_server(tmp_path: Path, creds_dir: Path) -> Iterator[tuple[NatsServer, Path]]:
    ca = make_self_signed_ca(tmp_path / "tls")
    cert = issue_certificate(ca, tmp_path / "tls", "server", hosts=("localhost", "127.0.0.1"))
    srv = NatsServer(tmp_path / "nats-tls", creds=creds_dir, tls=cert).start()
    try:
        yield srv, tmp_path / "tls"
    finally:
        srv.stop()


async def test_tls_client_connects_and_a_plain_one_is_refused_clearly(tls_server: tuple[NatsServer, Path]) -> None:
    srv, _ = tls_server
    assert srv.url.startswith("tls://")
    nc = await nats.connect(srv.url, **srv.client_options("worker"), allow_reconnect=False)
    try:
        assert nc.connected_url is not None and nc._transport is not None
        assert (await nc.jetstream().account_info()).api is not None
    finally:
        await nc.close()

    plain_url = srv.url.replace("tls://", "nats://")
    with pytest.raises(ssl.SSLError) as plain:  # credentials, but no CA: the server's certificate is not trusted
        await nats.connect(plain_url, **{k: v for k, v in srv.client_options("worker").items() if k != "tls"},
                           allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    message = explain_connect_error(plain.value, plain_url)
    assert "requires TLS" in message and ENV_TLS_CA in message


async def test_tls_with_client_certificates(tmp_path: Path, creds_dir: Path) -> None:
    ca = make_self_signed_ca(tmp_path / "tls")
    server_files = issue_certificate(ca, tmp_path / "tls", "server")
    client_files = issue_certificate(ca, tmp_path / "tls", "worker-host", client=True)
    assert stat.S_IMODE(client_files.key.stat().st_mode) == 0o600  # type: ignore[union-attr]
    with NatsServer(tmp_path / "nats", creds=creds_dir, tls=server_files, verify_clients=True) as srv:
        with pytest.raises((ConnectionError, ssl.SSLError)):  # no client certificate: the handshake is cut
            await nats.connect(srv.url, **connect_options(creds_dir / "worker.nk", TlsFiles(ca=ca.cert)),
                               allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
        nc = await nats.connect(srv.url, **connect_options(creds_dir / "worker.nk", client_files),
                                allow_reconnect=False)
        await nc.jetstream().account_info()
        await nc.close()


# ---- the old constructor --------------------------------------------------------------------------

async def test_without_creds_the_server_is_open_as_before(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "nats") as srv:
        assert "authorization" not in srv.config_file.read_text()
        nc = await nats.connect(srv.url, allow_reconnect=False)
        await ensure_streams(nc.jetstream(), QUEUE)
        await nc.jetstream().publish(work_subject(BASE), b"kept")
        await nc.close()
        srv.restart()  # same port, same file store
        nc = await nats.connect(srv.url, allow_reconnect=False)
        assert (await nc.jetstream().stream_info(QUEUE.stream)).state.messages == 1
        await nc.close()
