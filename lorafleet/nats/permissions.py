"""Who may do what on lorafleet's NATS: the four roles and each one's permissions, as subject templates.

A role is a fixed permission set (`PERMISSIONS`); `Layout` fills in the stream and bucket names the
templates refer to. The credentials that carry a role and the server's authorization block rendered from
this table are in auth.py (docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from lorafleet.core.heartbeats import STATS_PREFIX
from lorafleet.core.wire import (
    DLQ_PREFIX,
    FLEET_CONFIG_KV_BUCKET,
    FLEET_KV_BUCKET,
    HEARTBEAT_PREFIX,
    INBOX_PREFIX,
    PRESENCE_PREFIX,
    WORK_PREFIX,
)

Role = Literal["admin", "gateway", "worker", "control"]
ROLES: tuple[Role, ...] = get_args(Role)

PRIVATE_INBOX = "_LF_INBOX"  # per-credential reply namespace, outside the gateways' `_INBOX.>`


@dataclass(frozen=True, slots=True)
class Permissions:
    """Subjects a role may publish to and subscribe to (allow lists: everything else is refused)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # Carved out of `publish` (nats-server: a deny wins over any allow that also matches).
    publish_deny: tuple[str, ...] = ()
    # Lets a gateway answer the receipt request of a result it received (once, to that reply subject
    # only) without any static right to publish into workers' inboxes.
    allow_responses: bool = False


# --- The permission table ------------------------------------------------------------------------
# Templates: {me} this credential's public key; {work}, {dlq} the stream names; {kv} the fleet
# bucket's stream (KV_<bucket>); {bucket} the bucket; {cfgkv} the stream of the bucket that holds the fleet
# file (`lorafleet up` writes it with admin, nobody else may). No role but admin has STREAM.CREATE/UPDATE/DELETE/
# PURGE: a stream's creator chooses its whole config (a RePublish into `$KV.<config bucket>._fleet` rewrites the
# fleet file) and NATS permissions name the stream, never its config; admin's layout keeper (layout.py) heals a
# lost one. Consumers stay: the workers' (CONSUMER.CREATE on the work stream) and every reader's (an ephemeral one
# on the fleet bucket, for a KV watch). A consumer stores nothing itself; what it (or any answer: every client names
# its reply subjects) delivers to `$KV.<config bucket>.>` is refused there, for that bucket is sealed (layout.py).
_OWN_INBOX = f"{PRIVATE_INBOX}.{{me}}.>"  # JetStream answers, pulled tasks, receipts, KV watch deliveries
_QUEUE_INFO = (
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.{work}", "$JS.API.STREAM.INFO.{dlq}",  # readiness
    "$JS.API.CONSUMER.INFO.{work}.*", "$JS.API.CONSUMER.LIST.{work}", "$JS.API.CONSUMER.NAMES.{work}",  # backlog
)
_KV_READ = (
    "$JS.API.STREAM.INFO.{kv}",  # js.key_value(): does the bucket exist
    "$JS.API.CONSUMER.CREATE.{kv}",  # watch: an ordered, ephemeral (unnamed) push consumer
    "$JS.API.CONSUMER.INFO.{kv}.*",  # the watch asks how many entries it replays
    "$JS.FC.{kv}.>",  # flow-control answers of that consumer
    "$JS.API.DIRECT.GET.{kv}", "$JS.API.DIRECT.GET.{kv}.>", "$JS.API.STREAM.MSG.GET.{kv}",  # kv.get
)
# Reading the fleet file once at start (`--nats-url` without `--fleet`): bucket info and kv.get, no watch.
_CONFIG_READ = (
    "$JS.API.STREAM.INFO.{cfgkv}",
    "$JS.API.DIRECT.GET.{cfgkv}", "$JS.API.DIRECT.GET.{cfgkv}.>", "$JS.API.STREAM.MSG.GET.{cfgkv}",
)
# The key where versions before the split kept the fleet file, still read by a worker of such a version.
_LEGACY_FLEET_FILE = "$KV.{bucket}._fleet"

PERMISSIONS: dict[Role, Permissions] = {
    # Everything, streams and buckets included: `lorafleet up`, migrations, `nats` by hand.
    "admin": Permissions(publish=(">",), subscribe=(">",)),
    "gateway": Permissions(
        publish=(
            f"{WORK_PREFIX}.>",  # tasks; the JetStream ack comes back on the private inbox
            *_QUEUE_INFO,  # a lost stream is waited for (admin's layout keeper creates it), never created here
            # Take back the tasks of a request the stream refused part of (by sequence), so none is computed
            # for nobody; it could already flood the stream, so this adds no new harm.
            "$JS.API.STREAM.MSG.DELETE.{work}",
            *_KV_READ,
            *_CONFIG_READ,
            f"{PRESENCE_PREFIX}.gateway.>",  # `lorafleet status` from any host
            f"{STATS_PREFIX}.gateway.>",  # per-version figures for `promote --watch` (issue 25)
        ),
        subscribe=(_OWN_INBOX, f"{INBOX_PREFIX}.{{me}}.>", f"{HEARTBEAT_PREFIX}.>"),
        allow_responses=True,
    ),
    "worker": Permissions(
        publish=(
            f"{INBOX_PREFIX}.>",  # results to gateways' inboxes (a request: the receipt comes back)
            f"{HEARTBEAT_PREFIX}.>",
            f"{PRESENCE_PREFIX}.worker.>",
            f"{DLQ_PREFIX}.>",
            "$JS.API.INFO", "$JS.API.STREAM.INFO.{work}", "$JS.API.STREAM.INFO.{dlq}",
            # Create/bind the durable consumer: nats-py sends a durable_name-only config (queue.ensure_consumer)
            # to DURABLE.CREATE, a named one with a filter to CREATE.<stream>.<name>.<filter>. A consumer
            # name is one token, so `workers-*` would be a literal: hence `*`.
            "$JS.API.CONSUMER.DURABLE.CREATE.{work}.*", "$JS.API.CONSUMER.CREATE.{work}.*.>",
            "$JS.API.CONSUMER.INFO.{work}.*",
            "$JS.API.STREAM.MSG.GET.{work}",  # placement: the oldest waiting task's age
            "$JS.API.CONSUMER.MSG.NEXT.{work}.*",  # fetch
            "$JS.ACK.{work}.>",  # ack, nak, term, in-progress
            *_KV_READ,
            *_CONFIG_READ,
        ),
        subscribe=(_OWN_INBOX,),
    ),
    # promote/rollback (and a CI job that promotes): served names, staged preloads, promote locks. Never the
    # fleet file, which names what workers execute: it lives in the config bucket, which only admin writes;
    # nor the old `_fleet` key a worker of an older version may still read. No STREAM.CREATE (see above).
    "control": Permissions(
        publish=(
            "$KV.{bucket}.>",  # put / delete / purge a key (not the bucket)
            *_QUEUE_INFO,
            *_KV_READ,
            f"{PRESENCE_PREFIX}.control.>",  # a `promote --watch` says it is alive (`lorafleet status`)
        ),
        subscribe=(_OWN_INBOX, f"{HEARTBEAT_PREFIX}.>", f"{PRESENCE_PREFIX}.>", f"{STATS_PREFIX}.gateway.>"),
        publish_deny=(_LEGACY_FLEET_FILE,),
    ),
}


@dataclass(frozen=True, slots=True)
class Layout:
    """The names the permissions refer to; defaults are lorafleet's (config.QueueConfig, wire)."""

    work_stream: str = "LORAFLEET_WORK"
    dlq_stream: str = "LORAFLEET_DLQ"
    bucket: str = FLEET_KV_BUCKET
    config_bucket: str = FLEET_CONFIG_KV_BUCKET

    def render(self, template: str, public_key: str) -> str:
        return template.format(me=public_key, work=self.work_stream, dlq=self.dlq_stream,
                               kv=f"KV_{self.bucket}", bucket=self.bucket, cfgkv=f"KV_{self.config_bucket}")
