"""JetStream layout: the work-queue stream, its per-base consumers, and the dead-letter stream.

Gateways and workers both call `ensure_streams`; the calls are idempotent, so whichever part
starts first creates the layout and the others find it.
"""

from __future__ import annotations

from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError, NotFoundError

from lorafleet.config import QueueConfig
from lorafleet.wire import DLQ_PREFIX, WORK_PREFIX, consumer_name, work_subject

# JetStream error codes the gateway turns into HTTP statuses.
JS_ERR_STREAM_FULL = {10077, 10047}  # maximum messages / bytes exceeded (discard-new)


def _storage(cfg: QueueConfig) -> api.StorageType:
    return api.StorageType.FILE if cfg.storage == "file" else api.StorageType.MEMORY


def work_stream_config(cfg: QueueConfig) -> api.StreamConfig:
    return api.StreamConfig(
        name=cfg.stream,
        subjects=[f"{WORK_PREFIX}.>"],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=_storage(cfg),
        max_msgs=cfg.max_msgs,
        max_bytes=cfg.max_bytes,
        # Full stream → publish fails → gateway answers 429; never silently drop old tasks.
        discard=api.DiscardPolicy.NEW,
        duplicate_window=cfg.duplicate_window_s,
    )


def dlq_stream_config(cfg: QueueConfig) -> api.StreamConfig:
    return api.StreamConfig(
        name=cfg.dlq_stream,
        subjects=[f"{DLQ_PREFIX}.>"],
        retention=api.RetentionPolicy.LIMITS,
        storage=_storage(cfg),
        max_age=cfg.dlq_max_age_s,
        discard=api.DiscardPolicy.OLD,
    )


async def _ensure_stream(js: JetStreamContext, config: api.StreamConfig) -> None:
    try:
        await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
        except BadRequestError as exc:
            if exc.err_code != 10058:  # created concurrently by another process
                raise
        return
    await js.update_stream(config)


async def ensure_streams(js: JetStreamContext, cfg: QueueConfig) -> None:
    await _ensure_stream(js, work_stream_config(cfg))
    await _ensure_stream(js, dlq_stream_config(cfg))


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
