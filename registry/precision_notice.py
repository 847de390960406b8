"""What `promote` says about precision (issue 27): the bundle's tuned precision against what its base's workers serve.

A worker serves a base at one precision, the base's `precision:` in the fleet file, for every adapter on it (they
share the base's weights), so a bundle's tuned precision takes effect through its base: when the workers already
serve it (an explicit match, or `auto` resolving to it), promote says "serving at bf16 as tuned"; when they serve
another (the base is fp32, or `auto` fell back to fp32 on a worker without bf16), promote prints a notice naming the
workers — never an error: the adapter serves correctly at the base's precision, only not as tuned. Workers say what
they serve in their heartbeats (`pr`, base → precision); older workers say nothing and are named as unknown.

Issue 39: the entry carries the precision the bundle was judged at (`judged_profile`), and a base under `auto`
serves its models at what they were judged at (lorafleet.models.precision.served_precision). An explicit precision
in the
fleet file that differs is the operator's override: promote says so first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lorafleet.core import heartbeats
from lorafleet.core.config import ServingProfile
from lorafleet.core.fleet_state import FleetEntry
from lorafleet.core.wire import Heartbeat
from lorafleet.models.precision import AUTO, FP32, GATED, PRECISIONS
from lorafleet.registry.bundle import BundleSpec, judged_at

# Bundle kinds served by a runtime without a probe of its own (generation engines): with no tuned verdict they were
# judged at fp32 only, and a base under `auto` serves them at fp32 (lorafleet.models.precision.served_precision).
_PROBED_KINDS = frozenset({"sentence-transformers"})


@dataclass(frozen=True, slots=True)
class PrecisionNotice:
    """The verdict for one promotion: the tuned precision, what each worker of the base serves, and the words."""

    base: str
    tuned: str
    served: tuple[tuple[str, str | None], ...]  # (worker, precision it serves the base at; None: it does not say)
    as_tuned: bool  # every worker heard serves the tuned precision
    lines: tuple[str, ...]


def _workers(names: list[str]) -> str:
    return ("worker " if len(names) == 1 else "workers ") + ", ".join(sorted(names))


def judged_profile(profile: ServingProfile | None, spec: BundleSpec | None) -> ServingProfile | None:
    """The profile a fleet entry carries, its precision the one the bundle was judged at (issue 39: a base under
    `auto` serves it at that precision); None where the bundle has no tuned verdict."""
    if profile is None or spec is None:
        return profile
    judged = spec.precision or judged_at(spec.profile, spec.profile_source)
    return profile if profile.precision == judged else profile.model_copy(update={"precision": judged})


def judged_of(entry: FleetEntry) -> str | None:
    """What a promoted entry was judged at: its tuned verdict; else fp32 for a kind served without a probe (every
    gated number is fp32); None for an embedding bundle without one (a base under `auto` probes it)."""
    tuned = entry.profile.precision if entry.profile is not None else None
    if tuned in PRECISIONS:
        return tuned
    return GATED if entry.kind is not None and entry.kind not in _PROBED_KINDS else None


def precision_notice(base: str, tuned: str | None, served: Mapping[str, str | None],
                     declared: str | None = None) -> PrecisionNotice | None:
    """The notice for a bundle judged at `tuned` promoted onto base `base`, whose workers serve it as `served`
    (worker → precision, None where a worker does not report one), the fleet file setting `declared` on the base
    (None: not known). None when the bundle records no precision (not tuned, or tuned before precision was an
    axis): there is nothing to compare. A `declared` precision other than `tuned` is the operator's override and
    is said first."""
    if not tuned or tuned == AUTO:
        return None
    override: tuple[str, ...] = ()
    if declared and declared not in (AUTO, tuned):
        override = (f"judged at {tuned}; the fleet file overrides it with `precision: {declared}` on base {base}: "
                    f"served at {declared}, a precision no quality check measured for this model (set `precision: "
                    f"auto` there to serve what was judged)",)
    pairs = tuple(sorted(served.items()))
    if not pairs:
        return PrecisionNotice(base, tuned, pairs, False, (*override,
            f"tuned at {tuned}; no worker of base {base} was heard, so the precision it serves at is unknown "
            "(`lorafleet status` shows it once workers run)",))
    by: dict[str | None, list[str]] = {}
    for worker, precision in pairs:
        by.setdefault(precision, []).append(worker)
    if set(by) == {tuned} and not override:
        return PrecisionNotice(base, tuned, pairs, True, (f"serving at {tuned} as tuned (base {base}, "
                                                         f"{_workers(by[tuned])})",))
    lines: list[str] = list(override)
    for precision, workers in sorted(by.items(), key=lambda kv: (kv[0] is None, kv[0] or "")):
        if precision == tuned:
            lines.append(f"serving at {tuned} as tuned on {_workers(workers)}")
        elif precision is None:
            lines.append(f"tuned at {tuned}; {_workers(workers)} of base {base} do not report their precision "
                         "(an older lorafleet): it may differ")
        elif tuned == FP32:
            lines.append(f"tuned at {tuned}, the base {base} serves {precision} on {_workers(workers)}: tune's "
                         f"quality guard did not qualify a reduced precision for this adapter (see its tune report); "
                         f"set `precision: fp32` on base {base} in the fleet file to serve it as measured")
        else:
            why = ("a downgrade: correct results, slower than tuned" if precision == FP32
                   else "not the precision tune measured")
            lines.append(f"tuned at {tuned}, the base {base} serves {precision} on {_workers(workers)}: {why}. To "
                         f"serve it as tuned, set `precision: {tuned}` on base {base} in the fleet file (every adapter "
                         "of that base then serves at it) on workers that support it (docs/ship.md, Precision)")
    return PrecisionNotice(base, tuned, pairs, False, tuple(lines))


def served_by(seen: Mapping[str, Heartbeat], base: str) -> dict[str, str | None]:
    """Worker → the precision it serves `base` at, for the workers heard serving it (draining ones included)."""
    return {w: hb.precisions.get(base) for w, hb in seen.items() if base in hb.bases}


class HeartbeatListener:
    """The heartbeats heard while a promotion runs (the preload waits on them anyway), so the notice rarely waits."""

    def __init__(self) -> None:
        self.seen: dict[str, Heartbeat] = {}
        self.started = time.monotonic()
        self.sub: Any = None

    async def start(self, nc: Any) -> HeartbeatListener:
        def on_hb(hb: Heartbeat) -> None:
            self.seen[hb.worker] = hb

        self.sub = await heartbeats.subscribe(nc, on_hb)
        return self

    async def notice(self, base: str, tuned: str | None, heartbeat_s: float, declared: str | None = None
                     ) -> PrecisionNotice | None:
        """The notice for `base`, once a little over one heartbeat period has passed since the start (every live
        worker beats once per period, so all of them are heard); no wait when the bundle records no precision."""
        if not tuned or tuned == AUTO:
            return None
        left = self.started + 1.2 * heartbeat_s - time.monotonic()
        if left > 0:
            await asyncio.sleep(left)  # a listening window, not a wait for a state: heartbeats arrive meanwhile
        return precision_notice(base, tuned, served_by(self.seen, base), declared)

    async def close(self) -> None:
        if self.sub is not None:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()
