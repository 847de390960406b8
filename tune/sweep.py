"""`lorafleet tune`: the one sweep driver. It measures an adapter's candidates on this machine and recommends one.

Why a staged grid and not Optuna: the space is a few small, discrete, well-understood knobs; one
measured profile costs ~15 s here (worker restart + load points), so a budget of a few minutes
buys about ten profiles, too few for a sampler's model to beat a structured sweep; run-to-run noise
of 10–20 % on a shared machine misleads a sampler more than a grid; and the grid stops early along
the knob that matters most where throughput plateaus. The sweep is coordinate-wise: that knob first,
then the others around the best so far (each kind's `grid`).

Each candidate runs on a fresh worker process (only the worker restarts; NATS and the gateway stay
up), because the pull loop reads its profile (and an engine its options) once at start.

The driver owns what every kind does alike (kind.py: the call order); the kind that claims the adapter
(entry-point group `lorafleet.tune_kinds`) supplies the probe, the guard, the grid and the finish.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorafleet.core import settings
from lorafleet.tune.batching import TuneResult
from lorafleet.tune.config import GenerativeTuneConfig, TuneConfig
from lorafleet.tune.kind import KindSweep, Say, kind_for
from lorafleet.tune.source import TuneSource

__all__ = ["Say", "Sweep", "TuneResult", "drive", "run_tune"]


class Sweep:
    """One sweep's trials: each candidate measured once, within the profile cap and the time budget, announced
    before it runs (a worker restart and several load points: 15 s or more) and reported when measured."""

    def __init__(self, kind: KindSweep, budget_s: float, say: Say) -> None:
        self.kind, self.budget_s, self.say = kind, budget_s, say
        self.results: list[Any] = []
        self.t0 = time.monotonic()
        self.cap = 1
        self.at_most = 1

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def trial(self, candidate: Any, phase: str, *, first: bool = False, cap: int | None = None) -> Any | None:
        """The result of `candidate` (measured now, or earlier); None when the cap or the budget is reached."""
        kind = self.kind
        candidate = kind.normalise(candidate)
        key = kind.key(candidate)
        done = next((r for r in self.results if r.key() == key), None)
        if done is not None:
            return done
        limit = self.cap if cap is None else cap
        if not first and (len(self.results) >= limit or self.elapsed() > self.budget_s):
            return None
        self.say(f"  profile {len(self.results) + 1}/≤{self.at_most} ({phase}): {kind.describe(candidate)} "
                 f"measuring…  ({self.elapsed():.0f}s of {self.budget_s:.0f}s)")
        restart = 0.0 if first else kind.probe.apply(candidate)
        r = kind.probe.measure(candidate, phase, restart)
        self.results.append(r)
        self.say(f"  [{len(self.results):>2}/{self.at_most}] {kind.line(r)}  ({self.elapsed():.0f}s)")
        return r


def _terminate_as_interrupt() -> Callable[[], None]:
    """While the sweep runs, SIGTERM unwinds like Ctrl-C, so the private cluster is always stopped."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def out_folder(source: TuneSource, out_dir: Path | None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(out_dir) if out_dir else settings.home() / "tune" / f"{source.label}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def drive(make: Callable[[Path, Say], KindSweep], budget_s: float, out_dir: Path, say: Say) -> Any:
    """Run one kind's sweep in `out_dir`: guard, baseline, grid, finish; the cluster is always stopped, and the
    work folder (cluster logs) kept only when something failed."""
    work = out_dir / ".work"
    kind = make(work, say)
    say(kind.intro())
    sweep = Sweep(kind, budget_s, say)
    started = False

    def start() -> None:
        nonlocal started
        if not started:
            started = True
            say(f"  starting {kind.starting}…")
            kind.probe.start(kind.default())

    ok = False
    restore = _terminate_as_interrupt()
    try:
        quality = kind.guard(start)
        start()
        sweep.cap, sweep.at_most = kind.cap(quality), kind.planned(quality)
        sweep.trial(kind.default(), "baseline", first=True)
        kind.grid(sweep)
        ok = True
    finally:
        restore()
        kind.probe.stop()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
    result = kind.finish(sweep.results, quality, out_dir, sweep.elapsed())
    with contextlib.suppress(Exception):
        line = kind.done(result)
        if line:
            say(line)
    return result


def run_tune(source: TuneSource, cfg: TuneConfig | None = None, out_dir: Path | None = None,
             say: Say | None = None, generative: GenerativeTuneConfig | None = None
             ) -> Any:
    """Sweep with the tune kind that claims the adapter; its files (profile.yaml, results.csv, results.json, a
    plot, precisions.csv) go to `out_dir`; the result is the kind's (a batching kind's: TuneResult). A causal
    LM's LoRA gets the generation kind's sweep (the engine options of its base), with `generative` or, from
    `cfg`, its quick preset and memory limit."""
    cfg = cfg or TuneConfig()
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    kind = kind_for(source)
    kcfg = kind.config(cfg, generative)
    out = out_folder(source, out_dir)
    return drive(lambda work, say_: kind.sweep(source, kcfg, work, say_), kcfg.budget_s, out, say)
