"""Intake: what happens to every pulled message before anything is computed for it, whatever runs it.

Each message is held (kept alive with in_progress until it is settled) and decoded; malformed
tasks (a body that is no Task, a task for another base, generate parameters that do not parse) and
tasks whose deadline already passed are settled right here; tasks whose gateway is gone are dropped
uncomputed (`owners.OwnerTracker`: checked for redeliveries and for gateways that failed to take a
reply, so a first delivery to a live gateway costs nothing extra), and tasks whose gateway is away
(maybe reconnecting) go back for a later delivery, spread over the grace (settle.py). Shared by the
batch scheduler (scheduler.py) and the engine lanes (engine_lane.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from lorafleet.core.deadlines import local_deadline
from lorafleet.core.wire import GENERATE, SCORE, GenerateParams, MalformedTask, ScoreParams, Task
from lorafleet.sidecar.acks import Situation, is_last_delivery
from lorafleet.sidecar.batcher import Pulled
from lorafleet.sidecar.owners import Owner, OwnerTracker
from lorafleet.sidecar.settle import HeldTable, Settlement, Settler, num_delivered


class Intake:
    def __init__(self, held: HeldTable, settler: Settler, owners: OwnerTracker | None = None) -> None:
        self.held = held
        self.settler = settler
        self.owners = owners

    async def admit(self, base: str, msgs: list[Any]) -> list[Pulled]:
        """Decode and hold each message; malformed and already-expired tasks are settled right here."""
        now = time.time()
        mono = time.monotonic()
        out: list[Pulled] = []
        refused: list[Settlement] = []
        for msg in msgs:
            self.held.add(msg)
            try:
                task = Task.from_wire(msg.data)
                if task.base != base:
                    raise MalformedTask(f"task names base {task.base!r} but came on {base!r}'s subject")
                params = GenerateParams.of(task) if task.op == GENERATE else None
                if task.op == SCORE:
                    ScoreParams.of(task)  # checked here, like generate's: a bad one is settled, never computed
            except MalformedTask as exc:
                refused.append(Settlement(msg, base, Situation.MALFORMED, reason=str(exc), started=now))
                continue
            if local_deadline(task, received=now) <= now:  # fixed once here, on this host's clock
                refused.append(Settlement(msg, base, Situation.DEADLINE, task, "deadline passed in the queue",
                                          started=now))
                continue
            out.append(Pulled(task, msg, mono, params))
        if self.owners is not None and out:
            out = await self._drop_orphans(out, refused, now)
        if refused:
            await self.settler.settle_many(refused)
        return out

    async def _drop_orphans(self, pulled: list[Pulled], refused: list[Settlement], now: float) -> list[Pulled]:
        """Tasks whose gateway no longer listens are not computed: retried later (away) or dropped (gone)."""
        owners = self.owners
        assert owners is not None
        check = [p for p in pulled if num_delivered(p.msg) > 1 or owners.suspect(p.task.reply)]
        if not check:
            return pulled
        verdicts = await asyncio.gather(*(owners.status(p.task.reply) for p in check))
        bad = {id(p): v for p, v in zip(check, verdicts, strict=True) if v is not Owner.ALIVE}
        for p in pulled:
            verdict = bad.get(id(p))
            if verdict is Owner.GONE:
                owners.dropped += 1
                refused.append(Settlement(p.msg, p.task.base, Situation.ORPHANED, p.task,
                                          "its gateway is gone (nobody listens on its reply inbox)", started=now))
            elif verdict is Owner.AWAY:
                if is_last_delivery(num_delivered(p.msg), self.settler.queue.max_deliver):
                    owners.dropped += 1  # away at its last delivery too: dropped (ack table), not computed
                refused.append(Settlement(p.msg, p.task.base, Situation.OWNER_AWAY, p.task,
                                          "its gateway does not listen just now", started=now))
        return [p for p in pulled if id(p) not in bad]
