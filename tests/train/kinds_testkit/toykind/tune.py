"""The toy kind's tune strategy, built only on the public tune interface (lorafleet.tune.kind: TuneKind, KindSweep).

It claims adapters of peft task type `TOY_PAIRS`; its probe serves nothing (no cluster): a candidate is a batch
size whose throughput is a fixed curve, so a test sees the one driver run the guard, the baseline, the grid and
the finish. `STARTS` counts the probe's starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import yaml

from lorafleet.tune.kind import KindSweep, Say, TuneKind
from lorafleet.tune.source import TuneSource

STARTS: list[dict[str, int]] = []


@dataclass
class ToyMeasured:
    candidate: dict[str, int]
    phase: str
    pairs_per_s: float

    def key(self) -> tuple[Any, ...]:
        return tuple(sorted(self.candidate.items()))


class ToyProbe:
    def start(self, candidate: dict[str, int]) -> None:
        STARTS.append(candidate)

    def apply(self, candidate: dict[str, int]) -> float:
        return 0.0

    def measure(self, candidate: dict[str, int], phase: str, restart_s: float) -> ToyMeasured:
        batch = candidate["batch"]
        return ToyMeasured(dict(candidate), phase, 100.0 * min(batch, 8) - batch)  # best at 8

    def stop(self) -> None: ...


class ToySweep(KindSweep):
    def make_probe(self) -> ToyProbe:
        return ToyProbe()

    def intro(self) -> str:
        return f"tune (toy pairs): {self.source.label}"

    def default(self) -> dict[str, int]:
        return {"batch": 1}

    def planned(self, quality: list[Any]) -> int:
        return 5

    def grid(self, sweep: Any) -> None:
        for batch in (2, 4, 8, 16, 4):  # 4 again: the driver measures a candidate once
            sweep.trial({"batch": batch}, "batch")

    def finish(self, results: list[ToyMeasured], quality: list[Any], out_dir: Path, wall_s: float) -> dict[str, Any]:
        best = max(results, key=lambda r: r.pairs_per_s)
        (out_dir / "profile.yaml").write_text(yaml.safe_dump(best.candidate))
        return {"best": best.candidate, "results": results, "quality": quality}


class ToyTune(TuneKind):
    name: ClassVar[str] = "toy-pairs"
    task_types: ClassVar[frozenset[str | None]] = frozenset({"TOY_PAIRS"})

    def sweep(self, source: TuneSource, cfg: Any, work_dir: Path, say: Say) -> ToySweep:
        return ToySweep(source, cfg, work_dir, say)
