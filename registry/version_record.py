"""A registered version's record: the tags and description written at registration, read back as VersionInfo.

The version's tags carry a short, readable set: the kind's headline metrics (MLflow forbids '@' in tag keys, so
`test_ndcg@10` is tagged `test_ndcg_at_10`), the base model, the dataset digest, the profile source and the sha256
of bundle.yaml, which pins the whole bundle; every other metric lives in the bundle. The version's description
states the result in one sentence. registry/store.py writes and reads them; the names are re-exported there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import NamedTuple

from lorafleet.core.metrics import from_mlflow_key, mlflow_key
from lorafleet.core.tasks import MetricSpec
from lorafleet.registry.bundle import DEFAULT_TASK

CANDIDATE = "candidate"
CHAMPION = "champion"
TAG_SPEC_SHA = "bundle_sha256"
TAG_BASE = "base_model"
TAG_DIGEST = "dataset_digest"
TAG_HISTORY = "lorafleet.champion_history"  # registered-model tag: champion versions, oldest first
TAG_TASK = "lorafleet.task"


class RegistryError(RuntimeError):
    """The registry cannot do what was asked (unknown name/version, unreachable store); nothing was changed."""


class StoreUnreachable(RegistryError):
    """The MLflow store did not answer; retrying later may work."""


class BundleRef(NamedTuple):
    name: str
    version: str


@dataclass
class VersionInfo:
    name: str
    version: str
    source: str
    run_id: str | None
    aliases: list[str] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)

    def metric(self, name: str) -> float | None:
        raw = self.tags.get(mlflow_key(name))
        try:
            return float(raw) if raw is not None else None
        except ValueError:
            return None

    @property
    def base(self) -> str | None:
        return self.tags.get(TAG_BASE)

    @property
    def dataset_digest(self) -> str | None:
        """The digest of the dataset the version was trained and scored on (its test numbers belong to it)."""
        return self.tags.get(TAG_DIGEST) or None

    @property
    def task(self) -> str:
        """The task kind that trained this version (versions from before kinds were recorded: retrieval)."""
        return self.tags.get(TAG_TASK) or DEFAULT_TASK

    def metrics(self) -> dict[str, float]:
        """Every metric recorded in the version's tags, under its lorafleet name (`test_ndcg@10`)."""
        out: dict[str, float] = {}
        for k, v in self.tags.items():
            with contextlib.suppress(ValueError):
                out[from_mlflow_key(k)] = float(v)
        return out


def version_tags(metric_spec: MetricSpec, metrics: dict[str, float]) -> dict[str, str]:
    """A version's metric tags: the kind's headline set on test (adapter, base model, baseline), the objective
    on dev and what `registry list` shows, in that order, plus the headline's gain over the base
    (`test_ndcg_gain`). Every other metric lives in the bundle."""
    test = [m for m in metric_spec.headline_set if m.endswith(metric_spec.headline)]
    names = [*test, metric_spec.objective, *metric_spec.table]
    tags = {mlflow_key(k): f"{metrics[k]:.6g}" for k in dict.fromkeys(names) if k in metrics}
    headline, base = metric_spec.headline, metric_spec.base(metric_spec.headline)
    if headline in metrics and base in metrics:
        tags[f"{mlflow_key(headline).split('_at_')[0]}_gain"] = f"{metrics[headline] - metrics[base]:.6g}"
    return tags


def version_description(metric_spec: MetricSpec, metrics: dict[str, float], base: str, dataset_digest: str | None,
                        more: str | None = None) -> str:
    """The result in one sentence, then `more` (research's verdict) as a second paragraph:
    `test nDCG@10 0.440 vs base 0.315 (+40 %) and BM25 0.298; LoRA on all-MiniLM-L6-v2, trained on dataset 3f2a…`."""
    trained = f"LoRA on {base}" + (f", trained on dataset {dataset_digest[:12]}" if dataset_digest else "")
    summary = metric_spec.summary(metrics)
    text = f"{summary}; {trained}." if summary else f"{trained} (no test metrics recorded)."
    return f"{text}\n\n{more}" if more else text


def model_description(task: str, metric_spec: MetricSpec) -> str:
    return (f"lorafleet bundles of task kind `{task}`: a LoRA adapter, its base model, serving profile, evaluation "
            f"report and data digest. Each version's description states its test {metric_spec.label or 'score'} "
            "against the base model; alias `candidate` is the latest research winner, `champion` what the fleet "
            "serves.")


__all__ = ["CANDIDATE", "CHAMPION", "TAG_BASE", "TAG_DIGEST", "TAG_HISTORY", "TAG_SPEC_SHA", "TAG_TASK", "BundleRef",
           "RegistryError", "StoreUnreachable", "VersionInfo", "model_description", "version_description",
           "version_tags"]
