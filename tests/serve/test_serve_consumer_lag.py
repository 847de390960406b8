"""The gateway exports each base's consumer lag as JetStream reports it, and says it runs (presence):
a real gateway on a real nats-server, tasks queued with no worker to take them."""

from __future__ import annotations

import os
import time
import uuid

import httpx
import nats
from serve_harness import BASE, make_fleet, running_gateway, until, wait_ready

from lorafleet.core import wire
from lorafleet.core.heartbeats import PRESENCE_SUBJECT, Presence
from lorafleet.nats.queue import ensure_consumer
from lorafleet.serve.metrics import CONSUMER_LAG


async def test_consumer_lag_counts_tasks_nobody_takes(nats_server) -> None:
    fleet = make_fleet(nats_server.url, monitor_s=0.1)
    with running_gateway(fleet) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as client:
            await wait_ready(client)  # connected; the gateway created the stream
            nc = await nats.connect(nats_server.url)
            try:
                js = nc.jetstream()
                await ensure_consumer(js, BASE, fleet.queue)  # what a worker does first; then it died
                for i in range(5):
                    task = wire.Task(id=uuid.uuid4().hex, request_id="rq", index=i, model=BASE, base=BASE,
                                     text=f"text {i}", tokens=3, deadline=time.time() + 60, reply="_INBOX.none.x")
                    await js.publish(wire.work_subject(BASE), task.to_wire(), headers={wire.HDR_MSG_ID: task.id})
                consumer = wire.consumer_name(BASE)
                await until(lambda: gw.metric(CONSUMER_LAG, base=BASE, consumer=consumer) == 5.0, timeout=10)

                body = (await client.get("/metrics")).text  # what Prometheus scrapes
                assert f'{CONSUMER_LAG}{{base="{BASE}",consumer="{consumer}"}} 5.0' in body, body[-2000:]

                sub = await nc.subscribe(PRESENCE_SUBJECT)  # and the gateway says it runs, and is not ready
                presence = Presence.from_wire((await sub.next_msg(timeout=5.0)).data)
                assert (presence.role, presence.name, presence.state) == ("gateway", gw.gateway.gateway_id,
                                                                          "not-ready")
                assert presence.pid == os.getpid() and presence.restarts == 0
            finally:
                await nc.close()
