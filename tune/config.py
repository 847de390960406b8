"""The settings of a serving-profile sweep (`lorafleet tune`), and the error it raises."""

from __future__ import annotations

from pydantic import Field

from lorafleet.config import StrictModel


class TuneError(RuntimeError):
    """The sweep cannot run (bad input, the cluster did not start); the message says what to fix."""


class TuneConfig(StrictModel):
    slo_p99_ms: float = Field(250.0, gt=0, description="Latency objective: p99 at the offered load.")
    memory_gb: float | None = Field(None, gt=0, description="Peak worker memory limit (RSS, GiB).")
    quick: bool = Field(False, description="Three profiles, short load points: well under a minute.")
    concurrencies: list[int] = Field(default_factory=lambda: [1, 8, 32], min_length=1)
    open_fractions: list[float] = Field(default_factory=lambda: [0.5, 0.8], min_length=1,
                                        description="Open-loop rates as fractions of the baseline's capacity.")
    point_s: float = Field(2.5, gt=0, description="Seconds per load point.")
    warmup_s: float = Field(1.0, ge=0)
    min_open_requests: int = Field(30, ge=1, description="An open-loop point lasts long enough for this many "
                                   "arrivals (at most 3 × point_s), so its p99 rests on more than a handful.")
    items_grid: list[int] = Field(default_factory=lambda: [1, 4, 8, 16, 32, 64], min_length=1)
    wait_grid: list[float] = Field(default_factory=lambda: [0.0, 8.0])
    inflight_grid: list[int] = Field(default_factory=lambda: [0, 1, 2])
    tokens_per_item_grid: list[int] = Field(default_factory=lambda: [24, 96],
                                            description="max_batch_tokens = items × this.")
    plateau_gain: float = Field(0.03, ge=0, description="A larger batch must add this much throughput.")
    plateau_patience: int = Field(1, ge=1)
    max_profiles: int = Field(12, ge=1)
    budget_s: float = Field(300.0, gt=0, description="Stop starting new profiles after this long.")
    seed: int = 0
    device: str = "auto"

    @classmethod
    def quick_preset(cls, **overrides: object) -> TuneConfig:
        base: dict[str, object] = dict(quick=True, concurrencies=[8], open_fractions=[0.6], point_s=1.2,
                                       warmup_s=0.3, items_grid=[1, 8], wait_grid=[], inflight_grid=[],
                                       min_open_requests=15, tokens_per_item_grid=[], max_profiles=3, budget_s=45.0)
        base.update(overrides)
        return cls(**base)
