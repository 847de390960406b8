"""The tune kind: what a task kind supplies to the one sweep driver (sweep.py), and how the driver finds it.

A tune kind is a plugin, registered like a train kind (entry-point group `lorafleet.tune_kinds`, the built-ins
in lorafleet's own pyproject.toml): a `TuneKind` says which adapters it tunes (`claims`, by default by peft's task
type in adapter_config.json) and makes the `KindSweep` of one run. A `KindSweep` holds only the kind's parts:

- the probe (`make_probe`): what serves a candidate on the private cluster and measures it under the kind's load
  (`start`, `apply`, `measure`, `stop`; the driver never looks inside a candidate or a result but for `key()`);
- the guard (`guard`): the precision verdicts, judged once per precision before the sweep (default: fp32 only);
- the candidate grid (`default`, `grid`): the baseline candidate, then the staged candidates around the best;
- the finish (`finish`): the recommendation and the kind's files (profile.yaml and its results).

Call order in one run (all in the driver's thread): `intro`, `guard` (it calls `start()` once, before or after it
judges), `planned`, the baseline trial of `default()`, `grid`, then, after the probe stopped, `finish` and `done`.
The driver owns what every kind does alike: the output folder, the trial bookkeeping (one measurement per
candidate, the profile cap and the time budget), the progress lines, cleanup on SIGTERM and the work folder.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Final, Protocol

from lorafleet.core import plugins
from lorafleet.models.precision import FP32
from lorafleet.tune.config import TuneConfig, TuneError
from lorafleet.tune.precision import PrecisionQuality
from lorafleet.tune.source import TuneSource

if TYPE_CHECKING:
    from lorafleet.tune.config import GenerativeTuneConfig
    from lorafleet.tune.sweep import Sweep

TUNE_KINDS: Final = "lorafleet.tune_kinds"
Say = Callable[[str], None]


class Measured(Protocol):
    """A measured candidate: the driver only asks for its identity."""

    def key(self) -> tuple[Any, ...]: ...


class Probe(Protocol):
    """Serves a candidate on the private cluster and measures it under the kind's load."""

    def start(self, candidate: Any) -> None: ...

    def apply(self, candidate: Any) -> float: ...

    def measure(self, candidate: Any, phase: str, restart_s: float) -> Any: ...

    def stop(self) -> None: ...


class KindSweep(ABC):
    """One kind's parts of one sweep (see the module docstring for the call order)."""

    starting: ClassVar[str] = "a private cluster (nats-server, gateway, one worker)"

    def __init__(self, source: TuneSource, cfg: Any, work_dir: Path, say: Say) -> None:
        self.source, self.cfg, self.work_dir, self.say = source, cfg, work_dir, say
        self.probe: Probe = self.make_probe()

    @abstractmethod
    def make_probe(self) -> Probe:
        """The probe of this run (a cluster is started only by `start`)."""

    @abstractmethod
    def intro(self) -> str:
        """The sweep's first line: what is tuned, against which objective, in what budget."""

    @abstractmethod
    def default(self) -> Any:
        """The baseline candidate, measured first."""

    @abstractmethod
    def grid(self, sweep: Sweep) -> None:
        """The candidates after the baseline: `sweep.trial(candidate, phase)` each (None: cap or budget reached)."""

    @abstractmethod
    def finish(self, results: list[Any], quality: list[PrecisionQuality], out_dir: Path, wall_s: float) -> Any:
        """The recommendation and the kind's files; TuneError when no candidate could be measured."""

    # -- optional parts, with their defaults ---------------------------------------------------------------------
    def guard(self, start: Callable[[], None]) -> list[PrecisionQuality]:
        """The precision verdicts; calls `start()` (the private cluster) once. Default: fp32, nothing judged."""
        start()
        return [PrecisionQuality(FP32, True, "the reference")]

    def planned(self, quality: list[PrecisionQuality]) -> int:
        """At most how many candidates the sweep measures (the n of the `profile i/≤n` lines)."""
        return int(getattr(self.cfg, "max_profiles", 1))

    def cap(self, quality: list[PrecisionQuality]) -> int:
        """How many candidates `trial` measures at most, unless a trial names its own cap."""
        return int(getattr(self.cfg, "max_profiles", 1))

    def normalise(self, candidate: Any) -> Any:
        """One spelling per candidate, so equal candidates are measured once."""
        return candidate

    def key(self, candidate: Any) -> tuple[Any, ...]:
        """The identity of a candidate; equal to its result's `key()`."""
        return tuple(sorted(dict(candidate).items()))

    def describe(self, candidate: Any) -> str:
        """The candidate in a progress line."""
        return str(candidate)

    def line(self, result: Any) -> str:
        """A measured candidate in a progress line."""
        return str(result)

    def done(self, result: Any) -> str | None:
        """The sweep's last line (None: none)."""
        return None


class TuneKind(ABC):
    """A registered tune kind: which adapters it tunes, and the sweep of one run."""

    name: ClassVar[str]
    task_types: ClassVar[frozenset[str | None]] = frozenset()  # peft task types it claims (None: none recorded)

    def claims(self, source: TuneSource) -> bool:
        return adapter_task_type(source) in self.task_types

    def config(self, cfg: TuneConfig, generative: GenerativeTuneConfig | None) -> Any:
        """The kind's own config of this run, from the common one (default: the common one)."""
        return cfg

    @abstractmethod
    def sweep(self, source: TuneSource, cfg: Any, work_dir: Path, say: Say) -> KindSweep: ...


def adapter_task_type(source: TuneSource) -> str | None:
    """peft's task type recorded in the adapter folder (None: none, or no readable adapter_config.json)."""
    try:
        config = json.loads((Path(source.adapter_dir) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None
    task_type = config.get("task_type") if isinstance(config, dict) else None
    return str(task_type) if task_type is not None else None


def tune_kind_names() -> list[str]:
    return plugins.names(TUNE_KINDS)


def get_tune_kind(name: str) -> TuneKind:
    cls = plugins.load(TUNE_KINDS, name)
    return cls() if isinstance(cls, type) else cls


def kind_for(source: TuneSource) -> TuneKind:
    """The one registered tune kind that claims `source`; TuneError when none or several do."""
    kinds = [get_tune_kind(name) for name in tune_kind_names()]
    claiming = [k for k in kinds if k.claims(source)]
    if len(claiming) == 1:
        return claiming[0]
    task_type = adapter_task_type(source)
    if not claiming:
        raise TuneError(f"no tune kind takes an adapter of peft task type {task_type!r} ({source.adapter_dir}); "
                        f"known: {', '.join(k.name for k in kinds) or 'none'} (entry-point group '{TUNE_KINDS}')")
    raise TuneError(f"several tune kinds claim peft task type {task_type!r}: "
                    f"{', '.join(k.name for k in claiming)}; uninstall one")
