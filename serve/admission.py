"""Admission control: refuse at once (429) what the fleet cannot finish within the request's deadline.

The work queue is first in, first out per base, so a new request's tasks wait behind everything
already queued or being computed for that base (the backlog). The workers of the base measure how
many tasks they complete per busy second (their service rate, in heartbeats); the gateway adds
them up. A request of n inputs is admitted when

    backlog == 0   or   (backlog + n) / service_rate <= admit_fraction × deadline

and otherwise answered 429 with `Retry-After`: the time the backlog needs to drain to where the
request would fit. The rest of the deadline (1 − admit_fraction) absorbs batching, jitter and the
way back; admitted requests then rarely time out, and workers compute few answers nobody waits for.

A request of several inputs must also fit the stream whole (`fits`): its base's subject holds at most
`queue.max_msgs` tasks, and a request the stream takes only part of would leave tasks computed for nobody.

An idle queue admits anything (a deadline shorter than one batch is the client's choice, answered
504 if it passes); so does a base whose rate is not measured yet (no worker has computed for it):
the stream's own bound (`queue.max_msgs`) still applies. Pure arithmetic, unit-tested directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is refused and when to come back."""

    backlog: int
    rate_per_s: float
    predicted_s: float  # how long the request's tasks would take to finish
    budget_s: float  # admit_fraction × deadline
    retry_after_s: int

    def message(self, base: str, n: int) -> str:
        return (f"base model {base!r} is overloaded: {self.backlog} tasks are ahead of these {n}, and its workers "
                f"complete {self.rate_per_s:.0f} tasks/s, so the answer would take about {self.predicted_s:.1f} s; "
                f"this request's deadline allows {self.budget_s:.1f} s for waiting. Retry after "
                f"{self.retry_after_s} s, or send a longer X-Lorafleet-Deadline-Ms")


def judge(backlog: int, n: int, rate_per_s: float | None, deadline_s: float, admit_fraction: float | None,
          min_retry_after_s: int = 1) -> Refusal | None:
    """None to admit, or the Refusal (see the module docstring for the rule)."""
    if admit_fraction is None or backlog <= 0 or rate_per_s is None or rate_per_s <= 0.0:
        return None
    predicted = (backlog + n) / rate_per_s
    budget = admit_fraction * deadline_s
    if predicted <= budget:
        return None
    # The backlog drains at the service rate; once (backlog' + n) / rate fits the budget, this request would.
    drain_s = predicted - budget
    retry = min(max(math.ceil(drain_s), min_retry_after_s), MAX_RETRY_AFTER_S)
    return Refusal(backlog, rate_per_s, predicted, budget, retry)


def fits(backlog: int, n: int, max_msgs: int) -> bool:
    """Whether n more tasks fit a subject bounded by `max_msgs` that holds about `backlog` now."""
    return backlog + n <= max_msgs
