"""JetStream layout: the work-queue stream, its per-base consumers, and the dead-letter stream.

Who may change what (docs/security.md): only the admin credential creates or reconfigures a
stream: `lorafleet up` applies the layout (`ensure_streams(..., update=True)`), and its layout keeper
creates a lost one again (`update=False`; lorafleet/ops/layout.py). Gateways and workers wait for the
streams (`wait_for_stream`); workers create or re-create their durable consumer (`ensure_consumer`).
On a server without authentication a gateway still creates a missing stream itself: there, any
client may do anything, so it grants nothing.

The work stream carries exactly the served bases' subjects, each bounded on its own
(`max_msgs` per base, discard-new per subject), and drops tasks older than the largest deadline
(`FleetConfig.work_max_age_s`): a subject nobody serves cannot fill it, and nothing waits forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError, NotFoundError

from lorafleet.core.config import FleetConfig, QueueConfig
from lorafleet.core.wire import DLQ_PREFIX, WORK_PREFIX, consumer_name, work_subject

# JetStream error codes the gateway turns into HTTP statuses.
JS_ERR_STREAM_FULL = {10077, 10047, 10078}  # maximum messages / bytes / messages per subject exceeded
JS_ERR_STREAM_EXISTS = 10058


def _storage(cfg: QueueConfig) -> api.StorageType:
    return api.StorageType.FILE if cfg.storage == "file" else api.StorageType.MEMORY


def work_stream_config(cfg: QueueConfig, bases: Iterable[str] | None = None,
                       max_age_s: float | None = None, replicas: int = 1) -> api.StreamConfig:
    """The work stream; with `bases`, only their subjects (each bounded by max_msgs), else every work subject.

    `replicas` > 1 keeps that many copies on a JetStream cluster (FleetConfig.nats.replicas)."""
    subjects = sorted({work_subject(b) for b in bases}) if bases is not None else [f"{WORK_PREFIX}.>"]
    max_age = max_age_s if max_age_s is not None else cfg.max_age_s
    return api.StreamConfig(
        name=cfg.stream,
        subjects=subjects,
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=_storage(cfg),
        num_replicas=replicas,
        max_msgs=cfg.max_msgs * len(subjects),
        max_msgs_per_subject=cfg.max_msgs,
        max_bytes=cfg.max_bytes,
        max_age=max_age,
        # Full subject → publish fails → gateway answers 429; never silently drop old tasks.
        discard=api.DiscardPolicy.NEW,
        discard_new_per_subject=True,
        # JetStream refuses a duplicate window longer than the max age (a task older than that is gone anyway).
        duplicate_window=min(cfg.duplicate_window_s, max_age) if max_age else cfg.duplicate_window_s,
    )


def fleet_work_stream_config(fleet: FleetConfig) -> api.StreamConfig:
    return work_stream_config(fleet.queue, [b.name for b in fleet.bases], fleet.work_max_age_s(),
                              fleet.nats.stream_replicas())


def dlq_stream_config(cfg: QueueConfig, replicas: int = 1) -> api.StreamConfig:
    return api.StreamConfig(
        name=cfg.dlq_stream,
        subjects=[f"{DLQ_PREFIX}.>"],
        retention=api.RetentionPolicy.LIMITS,
        storage=_storage(cfg),
        num_replicas=replicas,
        max_age=cfg.dlq_max_age_s,
        discard=api.DiscardPolicy.OLD,
    )


async def stream_exists(js: JetStreamContext, name: str) -> bool:
    try:
        await js.stream_info(name)
    except NotFoundError:
        return False
    return True


async def stream_created(js: JetStreamContext, name: str) -> str | None:
    """When the stream was created (the server's timestamp), None when it is missing: a new value is a new stream."""
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        return None
    return str(info.created)


async def _ensure_stream(js: JetStreamContext, config: api.StreamConfig, update: bool) -> bool:
    """Create the stream if missing (True when this call created it); reconfigure it only with `update`.

    A refused JetStream request gets no answer (it times out), so roles that may not update a stream
    must not try: `update` is for the admin credential (`lorafleet up`).
    """
    assert config.name is not None
    try:
        await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
        except BadRequestError as exc:
            if exc.err_code != JS_ERR_STREAM_EXISTS:  # created concurrently by another process
                raise
            return False
        return True
    if update:
        await js.update_stream(config)
    return False


async def ensure_streams(js: JetStreamContext, cfg: QueueConfig, *, bases: Iterable[str] | None = None,
                         max_age_s: float | None = None, update: bool = False, replicas: int = 1) -> bool:
    """The work and dead-letter streams exist (True when one had to be created); `update` reconfigures them."""
    created = await _ensure_stream(js, work_stream_config(cfg, bases, max_age_s, replicas), update)
    return await _ensure_stream(js, dlq_stream_config(cfg, replicas), update) or created


async def ensure_fleet_streams(js: JetStreamContext, fleet: FleetConfig, *, update: bool = False) -> bool:
    return await ensure_streams(js, fleet.queue, bases=[b.name for b in fleet.bases],
                                max_age_s=fleet.work_max_age_s(), update=update, replicas=fleet.nats.stream_replicas())


async def wait_for_stream(js: JetStreamContext, name: str, *, poll_s: float = 0.5,
                          on_wait: Callable[[], None] | None = None) -> None:
    """Return once the stream exists (only admin creates it: `lorafleet up` and its layout keeper)."""
    first = True
    while not await stream_exists(js, name):
        if first and on_wait is not None:
            on_wait()
        first = False
        await asyncio.sleep(poll_s)


def consumer_config(base: str, cfg: QueueConfig) -> api.ConsumerConfig:
    backoff = cfg.effective_backoff()
    return api.ConsumerConfig(
        durable_name=consumer_name(base),
        filter_subject=work_subject(base),
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        # With backoff set, the server times redeliveries by it; ack_wait is its first step.
        ack_wait=backoff[0] if backoff else cfg.ack_wait_s,
        backoff=backoff or None,
        max_deliver=cfg.max_deliver,
        max_ack_pending=cfg.max_ack_pending,
        max_waiting=512,
    )


async def ensure_consumer(js: JetStreamContext, base: str, cfg: QueueConfig) -> str:
    """Create (or update) the durable pull consumer shared by all workers of `base`."""
    config = consumer_config(base, cfg)
    await js.add_consumer(cfg.stream, config)
    return config.durable_name or consumer_name(base)


@dataclass(frozen=True, slots=True)
class ConsumerState:
    """One base's consumer as the server reports it; `exists` False when it is missing."""

    exists: bool
    pending: int = 0  # not yet delivered
    ack_pending: int = 0  # delivered, not yet acked (being computed, or waiting for redelivery)
    waiting_pulls: int = 0
    redelivered: int = 0

    @property
    def backlog(self) -> int:
        return self.pending + self.ack_pending


async def consumer_state(js: JetStreamContext, cfg: QueueConfig, base: str) -> ConsumerState:
    try:
        info = await js.consumer_info(cfg.stream, consumer_name(base))
    except NotFoundError:
        return ConsumerState(False)
    return ConsumerState(True, info.num_pending or 0, info.num_ack_pending or 0, info.num_waiting or 0,
                         info.num_redelivered or 0)


async def queue_depth(js: JetStreamContext, cfg: QueueConfig) -> dict[str, dict[str, int]]:
    """Per consumer: pending (not yet delivered), ack_pending (delivered, not acked), redelivered."""
    out: dict[str, dict[str, int]] = {}
    for info in await js.consumers_info(cfg.stream):
        out[info.name] = {
            "pending": info.num_pending or 0,
            "ack_pending": info.num_ack_pending or 0,
            "redelivered": info.num_redelivered or 0,
            "waiting_pulls": info.num_waiting or 0,
        }
    return out
