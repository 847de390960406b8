"""What a research run produced: the typed result the pipeline ships (tune + register) and the CLI prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lorafleet.research.study import jsonable


@dataclass
class ResearchResult:
    """What a research run produced. `candidate` is True only for a winner that beat the base by the margin.

    The pipeline's ship step takes `task`, `winner_adapter_dir`, `winner_config` and the metrics from here.
    """

    study: str
    storage: str
    experiment: str
    parent_run_id: str
    objective: str
    task: str = "retrieval"
    # What the winner was judged against: the baselines of its own config (its data; rerank: its own first stage
    # and depth) and the kind's rivals; before a winner, the `train:` section's. The bundle records these.
    baseline: dict[str, float] = field(default_factory=dict)
    margin: float | None = None  # the relative margin it was judged by (research.min_margin); promotion gates at it
    winner_trial: int | None = None
    winner_params: dict[str, Any] = field(default_factory=dict)
    winner_config: dict[str, Any] = field(default_factory=dict)
    winner_adapter_dir: str | None = None  # on this machine (downloaded from winner_adapter_uri when that is set)
    winner_adapter_uri: str | None = None  # `runs:/RUN_ID/adapter`: the winning trial's adapter in MLflow
    winner_metrics: dict[str, float] = field(default_factory=dict)  # dev_* and test_* of the winner
    reseed_metrics: dict[str, float] = field(default_factory=dict)  # the same, second seed
    spread: dict[str, float] = field(default_factory=dict)
    candidate: bool = False
    verdict: str = ""
    finalized: bool = False
    report_path: str | None = None
    trials: dict[str, int] = field(default_factory=dict)
    dataset_digest: str | None = None

    def to_json(self) -> dict[str, Any]:
        return jsonable(self.__dict__)
