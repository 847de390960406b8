"""The agent benchmark's scenarios (bench/scenarios/*.yaml): models, the agent's DAG, shifting traffic.

A scenario is data, so that a new one runs without code:

    name: contract-review
    slo_ms: 4000                    # p99 of one document's whole DAG, arrival to last answer
    workers: 6                      # N, the same for every contender
    worker_memory_mb: 1200          # each worker's budget for resident bases
    models:                         # per-model batch cost a + b·n ms, resident memory, load time
      clause-embed: {kind: embed, a_ms: 9, b_ms: 4.4, memory_mb: 180, load_ms: 1400}
    documents:                      # per document type: stages in order; a stage's calls run at once
      standard:
        - {clause-embed: 8}
        - {clause-rerank: 2}
    phases:                         # the traffic: document mix per phase (shares), bursts or Poisson
      - {seconds: 20, mix: {standard: 1.0}}
      - {seconds: 20, mix: {standard: 0.3, drafting: 0.7}, bursts: true}

The pure parts of the benchmark live here: the trace, each model's offered load, the capacity that
sets the rate ladder, and the hindsight splits the dedicated and router contenders get.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelCost(_Strict):
    kind: Literal["embed", "rerank", "generate"]
    a_ms: float = Field(ge=0, description="fixed cost of one batch")
    b_ms: float = Field(ge=0, description="cost per item in the batch")
    memory_mb: int = Field(ge=1, description="resident memory of the base with its runtime")
    load_ms: float = Field(0.0, ge=0, description="cold start: loading the base")
    max_batch: int = Field(32, ge=1)
    calibrated_from: str = ""  # the real model and run its numbers come from

    def per_item_ms(self) -> float:
        """Cost per call at full batches: the least a call can cost the cluster."""
        return self.b_ms + self.a_ms / self.max_batch


class Phase(_Strict):
    seconds: float = Field(gt=0)
    mix: dict[str, float]
    bursts: bool = False  # 2.5× the rate for 250 ms of every second, 0.5× otherwise (same mean)


class Scenario(_Strict):
    name: str
    description: str = ""
    slo_ms: float = Field(gt=0)
    workers: int = Field(ge=1)
    worker_memory_mb: int = Field(ge=1)
    models: dict[str, ModelCost]
    documents: dict[str, list[dict[str, int]]]
    phases: list[Phase] = Field(min_length=1)
    rate_fractions: list[float] = Field(default_factory=lambda: [0.4, 0.55, 0.7, 0.85, 1.0])

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        for doc, stages in self.documents.items():
            for stage in stages:
                unknown = sorted(set(stage) - set(self.models))
                if unknown:
                    raise ValueError(f"document {doc!r} calls {unknown}: not among models {sorted(self.models)}")
        for i, ph in enumerate(self.phases):
            unknown = sorted(set(ph.mix) - set(self.documents))
            if unknown or not any(v > 0 for v in ph.mix.values()):
                raise ValueError(f"phase {i + 1}: mix {ph.mix} must name documents of {sorted(self.documents)} "
                                 "with a positive share")
        big = [m for m, c in self.models.items() if c.memory_mb > self.worker_memory_mb]
        if big:
            raise ValueError(f"models {big} exceed worker_memory_mb={self.worker_memory_mb}: no worker can hold them")
        return self

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    def calls_per_doc(self, doc: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for stage in self.documents[doc]:
            for m, n in stage.items():
                out[m] = out.get(m, 0) + n
        return out

    def mean_calls_per_doc(self) -> dict[str, float]:
        """Calls per model per document, averaged over the whole run (phases weighted by their length)."""
        out = dict.fromkeys(self.models, 0.0)
        for ph in self.phases:
            total = sum(ph.mix.values())
            for doc, share in ph.mix.items():
                for m, n in self.calls_per_doc(doc).items():
                    out[m] += n * share / total * ph.seconds / self.seconds
        return out

    def load_ms_per_doc(self) -> dict[str, float]:
        """Worker-milliseconds each model costs per document, at full batches."""
        return {m: n * self.models[m].per_item_ms() for m, n in self.mean_calls_per_doc().items()}

    def capacity_docs_per_s(self, workers: int | None = None) -> float:
        """Documents/s that `workers` could carry with perfect pooling and full batches: the ladder's ceiling."""
        n = self.workers if workers is None else workers
        return n * 1000.0 / sum(self.load_ms_per_doc().values())


def load(path: Path) -> Scenario:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"scenario {path}: {exc}") from exc
    try:
        return Scenario.model_validate(data)
    except ValueError as exc:
        raise SystemExit(f"scenario {path}: {exc}") from exc


def default_files() -> list[Path]:
    return sorted(SCENARIO_DIR.glob("*.yaml"))


@dataclass(frozen=True)
class Arrival:
    t: float  # seconds from the start of the run
    doc: str


def trace(sc: Scenario, rate: float, seed: int) -> list[Arrival]:
    """Document arrivals at mean `rate`/s through the phases; the same seed gives every contender the same trace."""
    rng = random.Random(seed)
    out: list[Arrival] = []
    start = 0.0
    for ph in sc.phases:
        docs, shares = list(ph.mix), list(ph.mix.values())
        t = start
        end = start + ph.seconds
        while True:
            hi = ph.bursts and ((t - start) % 1.0) < 0.25
            r = rate * ((2.5 if hi else 0.5) if ph.bursts else 1.0)
            gap = rng.expovariate(r)
            if ph.bursts:
                edge = start + math.floor(t - start) + (0.25 if hi else 1.0)
                if t + gap >= edge:  # memoryless: draw again from the rate change
                    t = edge
                    if t >= end:
                        break
                    continue
            t += gap
            if t >= end:
                break
            out.append(Arrival(t, rng.choices(docs, shares)[0]))
        start = end
    return out


def _largest_remainder(weights: dict[str, float], total: int, floor: int) -> dict[str, int]:
    """`total` seats split in proportion to `weights`, each at least `floor`."""
    seats = dict.fromkeys(weights, floor)
    left = total - floor * len(weights)
    if left <= 0:
        return seats
    w = sum(weights.values()) or 1.0
    exact = {k: left * v / w for k, v in weights.items()}
    for k, x in exact.items():
        seats[k] += int(x)
    rest = total - sum(seats.values())
    for k in sorted(exact, key=lambda k: exact[k] - int(exact[k]), reverse=True)[:rest]:
        seats[k] += 1
    return seats


def dedicated_split(sc: Scenario, workers: int) -> dict[str, int] | None:
    """Replicas per model for one Deployment per model: the best static split with hindsight (in proportion to
    each model's mean load, at least one each). None when there are fewer workers than models."""
    if workers < len(sc.models):
        return None
    return _largest_remainder(sc.load_ms_per_doc(), workers, 1)


def router_packing(sc: Scenario, workers: int) -> list[list[str]] | None:
    """What each worker holds for the placement-aware router, the best static packing with hindsight: one
    replica of each model (heaviest first), then replicas for whichever model carries the most load per
    replica, while one fits; each on the least loaded worker with the memory that does not hold it yet.
    None when some model fits nowhere."""
    load = sc.load_ms_per_doc()
    held: list[list[str]] = [[] for _ in range(workers)]
    free = [sc.worker_memory_mb] * workers
    work = [0.0] * workers
    replicas = dict.fromkeys(sc.models, 0)

    def place(m: str) -> bool:
        fits = [i for i in range(workers) if m not in held[i] and free[i] >= sc.models[m].memory_mb]
        if not fits:
            return False
        i = min(fits, key=lambda i: (work[i], -free[i]))
        held[i].append(m)
        free[i] -= sc.models[m].memory_mb
        work[i] += load[m]
        replicas[m] += 1
        return True

    for m in sorted(sc.models, key=lambda m: -load[m]):
        if not place(m):
            return None
    full: set[str] = set()
    while len(full) < len(sc.models):
        m = max((m for m in sc.models if m not in full), key=lambda m: load[m] / replicas[m])
        if not place(m):
            full.add(m)
    return held
