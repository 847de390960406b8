"""When nobody waits for a task any more, on the clock of the worker that holds it.

The gateway stamps two times on each task, both on its own wall clock: `enqueued` (when it published) and
`deadline`; their difference is the task's budget. A worker on another host reads them with its own clock,
which may be off by some skew. `local_deadline` turns a task into a deadline on the worker's clock, once,
when the worker takes the task (`received`), and every worker-side deadline check goes through it:

    local = min(deadline, received + (deadline - enqueued)) + tolerance

- `deadline` (read as if the clocks agreed) counts the time the task waited in the queue; with the worker's
  clock within `tolerance` of the gateway's it never expires early, and at most 2 × tolerance late.
- `received + budget` is true whatever the skew, since waiting in the queue never takes negative time: a
  worker whose clock is behind still lets a task go at most `tolerance` plus its wait in the queue late,
  instead of its whole skew late.
- `tolerance` (LORAFLEET_CLOCK_SKEW_S, default 0.25 s) is the bound a multi-host fleet promises on its clocks
  (NTP keeps them within milliseconds). A worker ahead by more than it drops live tasks early (504s); one
  behind by more than it is detected from `enqueued` (a task sent "in the future") and logged.

Tasks from gateways that sent no `enqueued` (0) fall back to `deadline + tolerance`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

from lorafleet.core.wire import Task

log = logging.getLogger(__name__)

ENV_CLOCK_SKEW = "LORAFLEET_CLOCK_SKEW_S"
DEFAULT_CLOCK_SKEW_S = 0.25
_WARN_EVERY_S = 60.0
_last_warning = 0.0


def clock_skew_s(environ: Mapping[str, str] | None = None) -> float:
    """The skew tolerated between a gateway's clock and a worker's, in seconds (LORAFLEET_CLOCK_SKEW_S)."""
    raw = (os.environ if environ is None else environ).get(ENV_CLOCK_SKEW)
    if not raw:
        return DEFAULT_CLOCK_SKEW_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_CLOCK_SKEW}={raw!r} is not a number of seconds") from None
    if not 0.0 <= value <= 60.0:
        raise ValueError(f"{ENV_CLOCK_SKEW}={raw!r}: expected 0 to 60 seconds")
    return value


def local_deadline(task: Task, received: float | None = None, tolerance_s: float | None = None) -> float:
    """The time on this worker's wall clock past which nobody waits for `task` (see the module docstring).

    Call it with `received` (this worker's time.time() when it took the task) once, at intake: the result is
    kept on the task (`Task.expires`) and every later call returns it. Without `received` and before that,
    the deadline as stamped plus the tolerance."""
    if task.expires is not None:
        return task.expires
    tolerance = clock_skew_s() if tolerance_s is None else tolerance_s
    deadline = task.deadline
    if received is None:
        return deadline + tolerance
    if task.enqueued > 0:
        deadline = min(deadline, received + (task.deadline - task.enqueued))
        if task.enqueued - received > tolerance:
            _warn_behind(task.enqueued - received, tolerance)
    task.expires = deadline + tolerance
    return task.expires


def passed(task: Task, now: float | None = None) -> bool:
    """Whether nobody waits for `task` any more, by this worker's clock."""
    return (time.time() if now is None else now) >= local_deadline(task)


def _warn_behind(behind_s: float, tolerance_s: float) -> None:
    global _last_warning
    mono = time.monotonic()
    if mono - _last_warning >= _WARN_EVERY_S:
        _last_warning = mono
        log.warning("this host's clock is at least %.1f s behind a gateway's (a task was sent %.1f s in its future), "
                    "more than %s=%g: synchronise the clocks (NTP)", behind_s, behind_s, ENV_CLOCK_SKEW,
                    tolerance_s)
