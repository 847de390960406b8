"""The worker's NATS side: an asyncio loop in a background thread.

It pulls tasks, forms batches, hands them to the main thread (which runs the model) through a
bounded handoff, and settles each task by the ack table when the main thread posts the outcome
back. It also keeps held messages alive (in_progress) and publishes heartbeats. Per-task work
here is kept small: decode, reply, ack.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats

from lorafleet.config import FleetConfig, ServingProfile
from lorafleet.queue import consumer_config, ensure_consumer, ensure_streams
from lorafleet.sidecar.acks import REPLY_RESULT, Settle, Situation, decide
from lorafleet.sidecar.batcher import Batch, Pulled, form_batches
from lorafleet.sidecar.pull import IDLE_POLL_S, ArrivalRate, BatchTime, fill, wait_first
from lorafleet.wire import (
    HDR_DLQ_DELIVERIES,
    HDR_DLQ_REASON,
    HDR_DLQ_SUBJECT,
    HDR_MSG_ID,
    Heartbeat,
    MalformedTask,
    Result,
    Task,
    consumer_name,
    dlq_subject,
    heartbeat_subject,
    unpack,
)

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0  # initial connect; once connected, reconnects go on for ever
RESULT_RECEIPT_TIMEOUT_S = 2.0  # a gateway confirms a result within ms; longer means it is gone


@dataclass(slots=True)
class Outcome:
    """What the main thread made of one task of a batch."""

    situation: Situation
    vector: bytes | None = None
    message: str = ""


class _Held:
    __slots__ = ("last_progress", "msg")

    def __init__(self, msg: Any) -> None:
        self.msg = msg
        self.last_progress = time.monotonic()


def _num_delivered(msg: Any) -> int:
    try:
        return int(msg.metadata.num_delivered or 1)
    except Exception:
        return 1


def _stream_seq(msg: Any) -> int:
    try:
        return int(msg.metadata.sequence.stream)
    except Exception:
        return 0


def _reply_hint(payload: bytes) -> tuple[str, str, int] | None:
    """(reply, id, index) from a body that is not a valid Task, when they can still be read."""
    try:
        d = unpack(payload)
    except Exception:
        return None
    if isinstance(d, dict) and isinstance(d.get("r"), str) and isinstance(d.get("id"), str):
        index = d.get("i")
        return d["r"], d["id"], index if isinstance(index, int) else 0
    return None


class NatsSide:
    """Owns the NATS connection and everything async; the main thread talks to it via thread-safe calls."""

    def __init__(self, fleet: FleetConfig, nats_url: str, worker_id: str, bases: list[str],
                 profile_for: Callable[[str, str | None], ServingProfile]) -> None:
        self.fleet = fleet
        self.nats_url = nats_url
        self.worker_id = worker_id
        self.bases = bases
        self.profile_for = profile_for
        self.ready: queue.Queue[Batch | None] = queue.Queue()  # bounded by self._slots
        self.connected = threading.Event()
        self.error: BaseException | None = None
        self.adapters_snapshot: dict[str, list[str]] = {b: [] for b in bases}  # replaced whole by the main thread
        self.dims: dict[str, int] = {}
        self.thread = threading.Thread(target=self._thread_main, name="nats-loop", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._held: dict[int, _Held] = {}
        self._stopping = False
        self.stop_requested = False
        self._phase = ""
        self._pull_task: asyncio.Task[None] | None = None
        self._waiters: dict[str, asyncio.Task[Any]] = {}  # base → its open fetch(1), kept across cycles
        self._heads: dict[str, Any] = {}  # base → a message its waiter brought that no batch has taken yet
        self._psubs: dict[str, Any] = {}
        self._arrivals = ArrivalRate()
        self._batch_times = {b: BatchTime() for b in bases}  # measured compute time, for max_batch_ms
        self.tasks_done = 0
        self.batches_done = 0
        self.on_fleet_state: Callable[[dict[str, Any]], None] | None = None  # set by the worker
        self._fleet_watch: Any = None
        self._seq = 0
        q = fleet.queue
        self._max_deliver = q.max_deliver
        ack_wait = consumer_config(bases[0], q).ack_wait or q.ack_wait_s
        self._progress_every = max(ack_wait / 3.0, 0.05)  # well below ack_wait, so nothing is redelivered

    # ---- called from the main thread -------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def wait_connected(self) -> bool:
        while not self.connected.wait(0.2):
            if not self.thread.is_alive():
                return False
        return self.error is None

    def _post(self, fn: Callable[..., Any], *args: Any) -> bool:
        loop = self.loop
        if loop is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed between the check and the call
            return False
        return True

    def start_serving(self, dims: dict[str, int]) -> None:
        self.dims = dict(dims)
        self._post(self._models_ready.set)

    def request_stop(self) -> None:
        self.stop_requested = True  # seen by _main even if the loop does not exist yet
        self._post(self._begin_stop)

    def complete(self, batch: Batch, outcomes: list[Outcome], started: float,
                 encoded: tuple[int, float] | None = None) -> None:
        """Post a computed batch back; `encoded` is (items, seconds) of its encode, when it ran whole."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._complete(batch, outcomes, started, encoded), loop)
        except RuntimeError:
            log.warning("loop closed; results of a batch of %d dropped (the tasks were given back)", len(batch))

    # ---- the loop thread ----------------------------------------------------------------------
    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self.error = exc
            if not (isinstance(exc, ConnectionError) and self._stopping):
                log.error("NATS side failed: %s", exc, exc_info=not isinstance(exc, OSError))
        finally:
            self.connected.set()
            self.ready.put(None)  # tells the main thread to finish

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        # A slot is one batch queued or computing here; it frees when the main thread posts the outcome.
        self._slots = asyncio.Semaphore(self.fleet.worker.profile.batches_in_flight + 1)
        self._models_ready = asyncio.Event()
        self._stop = asyncio.Event()
        if self.stop_requested:
            self._begin_stop()
        self.nc = await self._connect()
        self.js = self.nc.jetstream()
        await ensure_streams(self.js, self.fleet.queue)
        for base in self.bases:
            await ensure_consumer(self.js, base, self.fleet.queue)
        log.info("connected to %s; consumers ready for %s", self.nats_url, ", ".join(self.bases))
        if self.on_fleet_state is not None:  # promoted bundles: URIs and profiles per adapter id
            from lorafleet.registry.fleet_state import FleetWatcher

            try:
                self._fleet_watch = FleetWatcher(self.js, self.on_fleet_state)
                await self._fleet_watch.start()
            except Exception as exc:
                log.warning("cannot watch the fleet state bucket: %r; using the fleet file only", exc)
        self.connected.set()
        waiters = [asyncio.ensure_future(self._models_ready.wait()), asyncio.ensure_future(self._stop.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        background: list[asyncio.Task[None]] = []
        served = not self._stop.is_set()
        if served:
            for base in self.bases:
                self._psubs[base] = await self.js.pull_subscribe_bind(
                    durable=consumer_name(base), stream=self.fleet.queue.stream
                )
            await self._publish_heartbeat(0.0)  # the launcher waits for this one to call the worker ready
            log.info("serving %s", ", ".join(self.bases))
            background = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._progress_loop())]
            self._pull_task = asyncio.create_task(self._pull_loop())
            await self._stop.wait()
            await self._drain()
        for t in background:
            t.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if served:
            await self._publish_heartbeat(0.0)  # last word: draining=True, in_flight 0
        if self._fleet_watch is not None:
            await self._fleet_watch.stop()
        for psub in self._psubs.values():
            try:
                await psub.unsubscribe()  # before drain(), which otherwise hangs on pull subscriptions
            except Exception as exc:
                log.debug("unsubscribe: %s", exc)
        await self.nc.drain()

    async def _connect(self) -> Any:
        """Connect, giving up after CONNECT_TIMEOUT_S or as soon as a stop is requested."""
        connect = asyncio.ensure_future(nats.connect(
            self.nats_url, name=f"lorafleet-worker-{self.worker_id}", max_reconnect_attempts=-1,
            error_cb=self._on_error, disconnected_cb=self._on_disconnect, reconnected_cb=self._on_reconnect,
        ))
        stop = asyncio.ensure_future(self._stop.wait())
        done, _ = await asyncio.wait([connect, stop], timeout=CONNECT_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if connect in done:
            return connect.result()
        connect.cancel()
        await asyncio.gather(connect, return_exceptions=True)
        why = "stop requested" if stop in done else f"no answer within {CONNECT_TIMEOUT_S:.0f}s"
        raise ConnectionError(f"cannot connect to NATS at {self.nats_url} ({why}); is nats-server running there?")

    async def _on_error(self, exc: Exception) -> None:
        log.warning("NATS error: %s", exc)

    async def _on_disconnect(self) -> None:
        # drain() at shutdown disconnects on purpose; only an unplanned loss is worth a warning.
        log.log(logging.INFO if self._stopping else logging.WARNING, "disconnected from NATS")

    async def _on_reconnect(self) -> None:
        log.info("reconnected to NATS")

    def _begin_stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        log.info("stopping: no new pulls; finishing %d in-flight task(s)", len(self._held))
        if self._pull_task is not None and self._phase == "slot":  # waiting for a free slot, holding nothing
            self._pull_task.cancel()
        self._stop.set()

    async def _drain(self) -> None:
        if self._pull_task is not None:
            await asyncio.wait([self._pull_task], timeout=IDLE_POLL_S + 2.0)
        await self._give_back_waiting()
        deadline = time.monotonic() + self.fleet.worker.drain_timeout_s
        while self._held and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if not self._held:
            log.info("drained: all in-flight tasks answered")
            return
        log.warning("drain timed out after %.1fs; giving back %d task(s)", self.fleet.worker.drain_timeout_s,
                    len(self._held))
        while True:
            try:
                self.ready.get_nowait()
            except queue.Empty:
                break
        for held in list(self._held.values()):
            await self._settle(held.msg, "", Situation.SHUTDOWN, reason="worker shut down before computing the task")

    # ---- pulling ------------------------------------------------------------------------------
    def _pull_cap(self, base: str) -> int:
        caps = [self.fleet.worker.profile.max_batch_items]
        caps += [m.profile.max_batch_items for m in self.fleet.models if m.base == base and m.profile]
        return max(caps)

    async def _pull_loop(self) -> None:
        """One loop over every base's consumer: a free slot goes to the base whose waiting task is oldest.

        A loop per base would let a base with an empty queue sit on a slot while another base has
        a backlog. Each base keeps one open fetch(1) (its waiter) across cycles; a slot fills one
        batch, from the base whose head task is oldest, so a worker never holds full batches of
        several bases at once (tasks that an idle peer could serve). A head that lands while the
        worker is busy waits, held and kept alive, for the next free slot.
        """
        caps = {base: self._pull_cap(base) for base in self.bases}
        max_wait_ms = self.fleet.worker.profile.max_wait_ms
        max_batch_ms = self.fleet.worker.profile.max_batch_ms
        while not self._stopping:
            self._phase = "slot"
            await self._slots.acquire()
            self._phase = "fetch"
            if self._stopping:
                self._slots.release()
                break
            head = await self._next_head()
            if head is None:
                self._slots.release()
                continue
            base, first = head
            now = time.monotonic()
            wait_ms = max_wait_ms if self._arrivals.worth_waiting(max_wait_ms, now) else 0.0
            cap = caps[base]
            if max_batch_ms is not None:
                cap = self._batch_times[base].max_items(max_batch_ms / 1000.0, cap)
            try:
                msgs = await fill(self._psubs[base], [first], cap, wait_ms)
            except Exception as exc:  # the first message is held: it still gets batched below
                log.warning("pull on %s failed: %s", base, exc)
                msgs = [first]
            self._arrivals.observe(len(msgs), now)
            pulled = await self._admit(base, msgs)
            batches = form_batches(pulled, self.profile_for) if pulled else []
            if not batches:
                self._slots.release()
                continue
            self._phase = "hold"
            for i, batch in enumerate(batches):  # several only when one base's tasks name several adapters
                if i:
                    await self._slots.acquire()
                self._seq += 1
                batch.seq = self._seq
                self.ready.put_nowait(batch)

    async def _next_head(self) -> tuple[str, Any] | None:
        """(base, message) of the oldest task held as a head, waiting for one when none is held."""
        if not self._heads:
            for base in self.bases:
                if base not in self._waiters:
                    self._waiters[base] = asyncio.create_task(self._wait_one(base))
            await asyncio.wait(list(self._waiters.values()), return_when=asyncio.FIRST_COMPLETED)
        for base, waiter in list(self._waiters.items()):
            if waiter.done():
                del self._waiters[base]
                msg = waiter.result()  # _wait_one does not raise
                if msg is not None:
                    self._heads[base] = msg
        if not self._heads:
            return None
        base = min(self._heads, key=lambda b: _stream_seq(self._heads[b]))  # one stream: lower is older
        return base, self._heads.pop(base)

    async def _wait_one(self, base: str) -> Any | None:
        try:
            msg = await wait_first(self._psubs[base])
        except Exception as exc:  # reconnecting, or the consumer is being recreated
            log.warning("pull on %s failed: %s", base, exc)
            await asyncio.sleep(0.5)
            return None
        if msg is not None:
            self._held[id(msg)] = _Held(msg)  # kept alive (in_progress) until a slot takes it
        return msg

    async def _give_back_waiting(self) -> None:
        """At shutdown: tasks that a waiter brought but no slot took go back to the queue at once."""
        waiters, self._waiters = self._waiters, {}
        if waiters:
            await asyncio.wait(list(waiters.values()), timeout=IDLE_POLL_S + 2.0)
        left = list(self._heads.items())
        self._heads = {}
        for base, waiter in waiters.items():
            if not waiter.done():
                waiter.cancel()
            elif waiter.result() is not None:
                left.append((base, waiter.result()))
        for base, msg in left:
            await self._settle(msg, base, Situation.SHUTDOWN, reason="worker shut down before taking the task")

    async def _admit(self, base: str, msgs: list[Any]) -> list[Pulled]:
        """Decode and hold each message; malformed and already-expired tasks are settled right here."""
        now = time.time()
        mono = time.monotonic()
        out: list[Pulled] = []
        for msg in msgs:
            self._held[id(msg)] = _Held(msg)
            try:
                task = Task.from_wire(msg.data)
                if task.base != base:
                    raise MalformedTask(f"task names base {task.base!r} but came on {base!r}'s subject")
            except MalformedTask as exc:
                await self._settle(msg, base, Situation.MALFORMED, reason=str(exc))
                continue
            if task.deadline <= now:
                await self._settle(msg, base, Situation.DEADLINE, task=task, reason="deadline passed in the queue")
                continue
            out.append(Pulled(task, msg, mono))
        return out

    # ---- settling -----------------------------------------------------------------------------
    async def _complete(self, batch: Batch, outcomes: list[Outcome], started: float,
                        encoded: tuple[int, float] | None = None) -> None:
        self._slots.release()
        if encoded is not None and batch.base in self._batch_times:
            self._batch_times[batch.base].observe(*encoded)
        n = len(batch.items)
        dim = self.dims.get(batch.base, 0)
        ok = [(item, out) for item, out in zip(batch.items, outcomes, strict=True) if out.situation is Situation.OK]
        # Results go out together; each is acked only after its gateway confirmed it (see _deliver).
        delivered = await asyncio.gather(*(
            self._deliver(Result(item.task.id, item.task.index, self.worker_id, vector=out.vector, dim=dim,
                                 queue_ms=max(started - item.task.enqueued, 0.0) * 1000.0, batch_size=n),
                          item.task.reply)
            for item, out in ok
        ))
        undelivered = {id(item) for (item, _), done in zip(ok, delivered, strict=True) if not done}
        for item, out in zip(batch.items, outcomes, strict=True):
            situation, reason = out.situation, out.message
            if id(item) in undelivered:
                situation, reason = Situation.UNDELIVERED, "no gateway confirmed the result"
            await self._settle(item.msg, batch.base, situation, task=item.task, reason=reason, batch_size=n,
                               replied=situation is Situation.OK)
        self.batches_done += 1

    async def _deliver(self, result: Result, reply: str) -> bool:
        """Send one result as a request and wait for the gateway's receipt.

        Core NATS drops a message nobody is subscribed to; a gateway that is reconnecting (or a
        server that just restarted) would never see the result of a task we then ack. With a
        receipt, "no responders" or a timeout leaves the task un-acked for redelivery instead.
        Duplicates that this can cause are dropped by the gateway.
        """
        try:
            await self.nc.request(reply, result.to_wire(), timeout=RESULT_RECEIPT_TIMEOUT_S)
            return True
        except Exception as exc:  # NoRespondersError, TimeoutError, connection errors
            log.info("result of task %s not confirmed (%s); it will be redelivered", result.task_id,
                     type(exc).__name__)
            return False

    async def _settle(self, msg: Any, base: str, situation: Situation, *, task: Task | None = None,
                      reason: str = "", batch_size: int = 0, replied: bool = False) -> None:
        deliveries = _num_delivered(msg)
        action = decide(situation, deliveries, self._max_deliver)
        try:
            # Results were already delivered with a receipt (_deliver); errors go out here.
            if action.reply not in (None, REPLY_RESULT) and not replied:
                target = (task.reply, task.id, task.index) if task else _reply_hint(msg.data)
                if target is not None:
                    body = Result(target[1], target[2], self.worker_id, error_code=action.reply,
                                  error_message=reason or situation.value, batch_size=batch_size).to_wire()
                    await self.nc.publish(target[0], body)
            settle = action.settle
            if action.dead_letter and not await self._dead_letter(msg, base, reason or situation.value, deliveries):
                settle = Settle.NAK  # keep the task rather than lose it; the next delivery tries again
            if settle is Settle.ACK:
                await msg.ack()
            elif settle is Settle.TERM:
                await msg.term()
            else:
                await msg.nak(delay=self.fleet.queue.nak_delay_s if action.nak_delay else None)
            if settle is not Settle.NAK:
                self.tasks_done += 1
            if situation is not Situation.OK:
                log.log(logging.INFO if situation is Situation.DEADLINE else logging.WARNING,
                        "task %s: %s → %s%s (delivery %d/%d)%s", task.id if task else "?", situation.value,
                        settle.value, " + dead-letter" if action.dead_letter else "", deliveries,
                        self._max_deliver, f": {reason}" if reason else "")
        except Exception as exc:
            log.error("settling a task (%s) failed: %s", situation.value, exc)
        finally:
            self._held.pop(id(msg), None)

    async def _dead_letter(self, msg: Any, base: str, reason: str, deliveries: int) -> bool:
        headers = {
            HDR_DLQ_REASON: reason.replace("\r", " ").replace("\n", " ")[:1000],
            HDR_DLQ_SUBJECT: msg.subject,
            HDR_DLQ_DELIVERIES: str(deliveries),
        }
        orig_id = (msg.headers or {}).get(HDR_MSG_ID)
        if orig_id:
            headers[HDR_MSG_ID] = f"dlq-{orig_id}"  # idempotent if a retry dead-letters it twice
        try:
            await self.js.publish(dlq_subject(base or msg.subject.rsplit(".", 1)[-1]), msg.data, headers=headers,
                                  stream=self.fleet.queue.dlq_stream)
            return True
        except Exception as exc:
            log.error("dead-letter publish failed (task kept for another delivery): %s", exc)
            return False

    # ---- keep-alives --------------------------------------------------------------------------
    async def _progress_loop(self) -> None:
        every = self._progress_every
        while True:
            await asyncio.sleep(every / 2)
            now = time.monotonic()
            for held in list(self._held.values()):
                if now - held.last_progress >= every:
                    held.last_progress = now
                    try:
                        await held.msg.in_progress()
                    except Exception as exc:
                        log.debug("in_progress failed: %s", exc)

    async def _heartbeat_loop(self) -> None:
        every = self.fleet.worker.heartbeat_s
        last_t, last_batches = time.monotonic(), self.batches_done
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            rate = (self.batches_done - last_batches) / max(now - last_t, 1e-6)
            last_t, last_batches = now, self.batches_done
            await self._publish_heartbeat(rate)

    async def _publish_heartbeat(self, batches_per_s: float) -> None:
        hb = Heartbeat(
            worker=self.worker_id, bases=list(self.bases), adapters=dict(self.adapters_snapshot),
            in_flight=len(self._held), batches_per_s=round(batches_per_s, 3), tasks_done=self.tasks_done,
            pid=os.getpid(), host=socket.gethostname(), draining=self._stopping,
        )
        try:
            await self.nc.publish(heartbeat_subject(self.worker_id), hb.to_wire())
        except Exception as exc:
            log.debug("heartbeat publish failed: %s", exc)
