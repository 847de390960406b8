"""lorafleet's NATS layout, and the one process that creates and heals it: the holder of the admin credential.

The layout: the work and dead-letter streams, the fleet bucket, and the bucket of the fleet file that
hosts which join read. Only admin creates or changes a stream (docs/security.md): a stream's creator
chooses its whole config, and a `RePublish` to `$KV.<config bucket>._fleet` would rewrite the fleet
file that names what joining workers run; NATS permissions name the stream, never its config. So
`lorafleet up` applies the layout with admin (`apply_layout`), and a `LayoutKeeper` in the same
process (`lorafleet layout` in a deployment, its own part) creates again what is lost:
a stream deleted by hand, a memory store gone with its server. Gateways and workers wait for it;
workers still create their own consumers (a pull consumer stores nothing anywhere).

The fleet file's bucket is sealed once written: any credential may name any reply subject, so a
JetStream answer (or a pulled task) sent to `$KV.<config bucket>._fleet` would otherwise be stored
there; a sealed stream stores nothing more. `apply_layout` makes it again when the file changed.

Healing creates, never reconfigures, and makes the buckets before the streams, so a gateway that sees
its work stream back finds the fleet bucket there too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import (
    BadRequestError,
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)

from lorafleet.core.config import FleetConfig, load_yaml_model
from lorafleet.core.fleet_state import (
    FLEET_CONFIG_KEY,
    ensure_config_bucket,
    ensure_fleet_bucket,
    purge_legacy_fleet_config,
    put_fleet_config,
    shared_fleet_config,
)
from lorafleet.core.wire import FLEET_CONFIG_KV_BUCKET, FLEET_KV_BUCKET
from lorafleet.nats.client import (
    RECONNECT_OPTIONS,
    add_client_arguments,
    quiet_tls_noise,
    server_urls,
    settings_from_args,
)
from lorafleet.nats.queue import ensure_fleet_streams, stream_exists
from lorafleet.ops.cluster_state import ClusterError

log = logging.getLogger(__name__)

LAYOUT_TIMEOUT_S = 30.0  # a cluster's JetStream may answer "temporarily unavailable" for a moment after start
CHECK_S = 1.0  # the keeper's look at the layout when no advisory or reconnect asked for one sooner
CONFIG_STREAM = f"KV_{FLEET_CONFIG_KV_BUCKET}"
# Every stream deletion in the account (admin may subscribe to anything): heal at once, not at the next look.
DELETED_ADVISORY = "$JS.EVENT.ADVISORY.STREAM.DELETED.>"


class LayoutError(ClusterError):
    """The layout could not be applied (JetStream unavailable, or someone keeps writing the sealed bucket)."""


async def fleet_config_sealed(js: Any, fleet: FleetConfig) -> bool:
    """The fleet file's bucket is sealed and its last message is exactly this fleet's file, under its key."""
    try:
        info = await js.stream_info(CONFIG_STREAM)
        if not info.config.sealed:
            return False
        entry = await (await js.key_value(FLEET_CONFIG_KV_BUCKET)).get(FLEET_CONFIG_KEY)
    except (NotFoundError, BucketNotFoundError, KeyNotFoundError, KeyDeletedError):
        return False
    return bool(entry.value == shared_fleet_config(fleet) and entry.revision == info.state.last_seq)


async def publish_fleet_config(js: Any, fleet: FleetConfig, attempts: int = 5) -> None:
    """The fleet file in its own bucket, sealed; kept when it already holds exactly this file and nothing after.

    A sealed stream cannot be unsealed, so a changed file means a new bucket: deleted and made again.
    Sealing after the write leaves a moment in which an answer sent there could land after it: the
    sealed bucket must then still end with this file, or it is made again. Two keepers doing this at
    once (a rollout) converge: identical writes pass that check, and one refused by the other's seal
    finds the bucket done at its next look."""
    for attempt in range(attempts):
        if await fleet_config_sealed(js, fleet):
            return
        if attempt:
            log.warning("the fleet file's bucket %s does not end with lorafleet's write (attempt %d); making it again",
                        FLEET_CONFIG_KV_BUCKET, attempt)
        with contextlib.suppress(NotFoundError):  # open, or sealed with another file: made again
            await js.delete_stream(CONFIG_STREAM)
        try:
            await put_fleet_config(await ensure_config_bucket(js, replicas=fleet.nats.stream_replicas()), fleet)
            config = (await js.stream_info(CONFIG_STREAM)).config
            if not config.sealed:
                config.sealed = True
                await js.update_stream(config)
        except (BadRequestError, NotFoundError, NoStreamResponseError, NoRespondersError) as exc:
            # sealed (a put refused) or deleted (nobody stores the put) meanwhile by another keeper
            log.debug("fleet file's bucket changed under this write: %r", exc)
    if not await fleet_config_sealed(js, fleet):
        raise LayoutError(f"the fleet file's bucket {FLEET_CONFIG_KV_BUCKET} kept receiving writes from elsewhere")


async def apply_layout(url: str, options: dict[str, Any], fleet: FleetConfig) -> None:
    """With the admin credential: the streams as the fleet file says (created or reconfigured), the fleet bucket,
    and the fleet file for processes on other hosts in its own sealed bucket, which only admin may write (it names
    what a joining worker runs; control, which writes the fleet bucket, must not choose that)."""
    quiet_tls_noise()
    nc = await nats.connect(server_urls(url), allow_reconnect=False, connect_timeout=5, **options)
    deadline = time.monotonic() + LAYOUT_TIMEOUT_S
    try:
        js = nc.jetstream()
        while True:
            try:
                kv = await ensure_fleet_bucket(js, replicas=fleet.nats.stream_replicas())
                await purge_legacy_fleet_config(kv)  # where older versions kept it, writable by control
                await publish_fleet_config(js, fleet)  # for workers and gateways that join from other hosts
                await ensure_fleet_streams(js, fleet, update=True)
                return
            except (ServiceUnavailableError, NoRespondersError, NatsTimeoutError) as exc:
                if time.monotonic() > deadline:  # a new cluster's stream leaders are still being elected
                    raise LayoutError(f"JetStream did not accept the streams within {LAYOUT_TIMEOUT_S:.0f}s: "
                                      f"{exc!r}") from exc
                await asyncio.sleep(0.2)
    finally:
        await nc.close()


async def heal_layout(js: Any, fleet: FleetConfig) -> list[str]:
    """Create what is missing of the layout (admin); the names created, [] when all was there. Never reconfigures."""
    healed: list[str] = []
    replicas = fleet.nats.stream_replicas()
    if not await stream_exists(js, f"KV_{FLEET_KV_BUCKET}"):
        await ensure_fleet_bucket(js, replicas=replicas)
        healed.append(f"KV_{FLEET_KV_BUCKET}")
    if not await stream_exists(js, CONFIG_STREAM):
        await publish_fleet_config(js, fleet)
        healed.append(CONFIG_STREAM)
    missing = [s for s in (fleet.queue.stream, fleet.queue.dlq_stream) if not await stream_exists(js, s)]
    if missing:
        await ensure_fleet_streams(js, fleet, update=False)
        healed += missing
    return healed


class LayoutKeeper:
    """Re-creates a lost part of the layout, with the admin credential, in a thread of its own.

    Looks at the layout every `check_s`, and at once after a stream-deleted advisory or a reconnect
    (a restarted server with a memory store has lost everything). `healed` counts the parts re-created;
    `on_event` (the CLI's console) hears of each."""

    def __init__(self, url: str, options: dict[str, Any], fleet: FleetConfig, *, check_s: float = CHECK_S,
                 on_event: Callable[[str], None] | None = None) -> None:
        self.url, self.options, self.fleet = url, options, fleet
        self.check_s = check_s
        self.on_event = on_event
        self.healed = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LayoutKeeper:
        self._thread = threading.Thread(target=lambda: asyncio.run(self.run()), name="lorafleet-layout-keeper",
                                        daemon=True)
        self._thread.start()
        self._started.wait()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended already
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _say(self, text: str) -> None:
        if self.on_event is not None:
            self.on_event(text)
        else:
            log.warning("%s", text)

    async def run(self) -> None:
        """Until `stop()`: connect (retrying forever), then keep the layout whole."""
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._started.set()
        look = asyncio.Event()

        async def reconnected() -> None:
            look.set()

        async def on_deleted(msg: Any) -> None:
            look.set()

        async def on_error(exc: Exception) -> None:
            log.debug("layout keeper: NATS: %r", exc)

        quiet_tls_noise()
        connecting = asyncio.ensure_future(nats.connect(
            server_urls(self.url), **RECONNECT_OPTIONS, connect_timeout=2, reconnected_cb=reconnected,
            error_cb=on_error, name="lorafleet-layout-keeper", **self.options))
        stopping = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait([connecting, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not connecting.done():  # stopped while the server was unreachable (it retries forever)
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
            return
        nc = connecting.result()
        try:
            await nc.subscribe(DELETED_ADVISORY, cb=on_deleted)
            js = nc.jetstream()
            while not self._stop.is_set():
                try:
                    healed = await heal_layout(js, self.fleet)
                except Exception as exc:  # reconnecting, JetStream electing a leader: look again soon
                    log.debug("layout keeper: %r", exc)
                    healed = []
                if healed:
                    self.healed += len(healed)
                    self._say(f"NATS layout: re-created {', '.join(healed)}")
                stop = asyncio.ensure_future(self._stop.wait())
                wake = asyncio.ensure_future(look.wait())
                await asyncio.wait([stop, wake], timeout=self.check_s, return_when=asyncio.FIRST_COMPLETED)
                for fut in (stop, wake):
                    fut.cancel()
                look.clear()
        finally:
            await nc.close()


def main(argv: list[str] | None = None) -> int:
    """Apply the layout with the admin credential (`--creds admin.nk`), then keep it: re-create what is lost."""
    parser = argparse.ArgumentParser(prog="python -m lorafleet.ops.layout", description=main.__doc__)
    parser.add_argument("--fleet", required=True, help="the fleet YAML (streams, replicas, the file to publish)")
    parser.add_argument("--nats-url", default=None, help="NATS server(s), comma-separated (default: the fleet's)")
    parser.add_argument("--once", action="store_true", help="apply the layout and exit (no healing)")
    add_client_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fleet = load_yaml_model(FleetConfig, args.fleet)
    url = args.nats_url or fleet.nats_url
    options = settings_from_args(args, fleet.nats).options()
    asyncio.run(apply_layout(url, options, fleet))
    log.info("NATS layout applied at %s%s", url, "" if args.once else "; keeping it")
    if not args.once:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(LayoutKeeper(url, options, fleet).run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
