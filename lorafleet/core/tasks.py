"""Task kinds: what kind of specialist a run makes, as one strategy object per kind.

A task kind (retrieval, generation, …) knows how to build its dataset (with digest and leakage
check), train a LoRA, evaluate one on a split, score the base model and a non-learned baseline,
which capability serves it, and how its quality gate reads. Research, the pipeline, the registry
and the CLI take all of that from the kind, never from a constant, so a new kind is a new module
plus an entry point (group `lorafleet.tasks`) and touches neither research's loop nor promotion.

Life of a kind in a research run (the order calls happen in):

    kind = get_task_kind(name)
    cfg = kind.parse_config(raw)                 # the `train:` section, validated by kind.config_model
    dataset = kind.build_dataset(cfg)            # once per data configuration (cached by dataset_key)
    baseline = kind.baselines(cfg, dataset)      # base_* and <baseline>_* on dev and test, once per baseline_key
    outcome = kind.train(cfg, dataset, out_dir, on_epoch=cb)   # per trial; dev only; cb(epoch, dev) may raise
    test = kind.evaluate(cfg, dataset, outcome.adapter_dir, "test")  # once per study, for the winner
    judged = kind.baselines(winner_cfg, its_dataset) | kind.rivals(winner_cfg, its_dataset, variants)
                                                 # what the winner is judged against: its own config's baselines

Everything runs in the caller's process and thread; `on_epoch` may raise (pruning, time limit) and
the kind must let that exception through. Metric names are flat: `{split}_{metric}` from the kind,
prefixes (`base_`, the baseline's name) from `lorafleet.core.metrics`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from lorafleet.core import plugins
from lorafleet.core.config import StrictModel, validate_model
from lorafleet.core.metrics import SPLITS, prefixed, to_test

EpochCallback = Callable[[int, dict[str, float]], None]
Direction = Literal["maximize", "minimize"]

# What a run cost, for every kind: `TrainResult.cost` (wall_s, cpu_s, peak_rss_mb, usd) prefixed `cost_`.
COST_HEADLINE = ("cost_wall_s", "cost_usd")
# The gate's relative margin: research's default `min_margin`, and promotion's for a version that records none.
DEFAULT_MARGIN = 0.02


@dataclass(frozen=True)
class Rival:
    """A further non-learned alternative the headline must beat by the margin, beside `MetricSpec.gate`: its
    metric prefix, its name in gate reasons and verdicts, and its column in reports."""

    prefix: str
    label: str
    column: str


@dataclass(frozen=True)
class MetricSpec:
    """The metrics a kind is judged by.

    `objective` is the dev metric research optimises by default; `objectives` the others research may be told to
    optimise, each with its direction (only scores of the adapter: a metric the adapter cannot move, or one that
    measures length, is not an objective); `headline` the test metric of a winner that the gate, the registry tags
    and the reports lead with. `baseline` is the prefix of the kind's
    non-learned baseline (`bm25`, `lead`) and `baseline_label` its name in tables. `table` lists
    what a version listing shows; `report` the metric names (without split) a report compares.
    Derived from these: `headline_set` (what runs and model versions lead with in MLflow), `summary`
    (the headline in words) and `rows` (any metrics as table rows, for the long tail).
    """

    objective: str
    direction: Direction = "maximize"
    baseline: str | None = None
    baseline_label: str = "baseline"
    label: str = ""
    table: tuple[str, ...] = ()
    report: tuple[str, ...] = ()
    # The prefix the gate compares against: `base` (the base model) or one that names the best of several
    # baselines (`best`: the generation kind's lead, base, k-shot and other-model k-shot), and its words.
    gate: str = "base"
    gate_label: str = "the base model"
    # Test metrics shown beside the headline in every run's headline set (`test_chrf`, `test_exact_match`).
    beside: tuple[str, ...] = ()
    # What the headline must also beat by the margin (rerank: the best first stage alone the search space holds).
    rivals: tuple[Rival, ...] = ()
    # Dev metrics research may optimise instead of `objective`, and their directions.
    objectives: tuple[tuple[str, Direction], ...] = ()
    # What a report says about how the numbers are measured (e.g. that relevance is binary).
    notes: tuple[str, ...] = ()

    @property
    def gates(self) -> tuple[tuple[str, str], ...]:
        """(prefix, label) of everything the headline must beat by the margin: `gate`, then each rival."""
        return ((self.gate, self.gate_label), *((r.prefix, r.label) for r in self.rivals))

    def objective_directions(self) -> dict[str, Direction]:
        """The dev metrics research may optimise, with their directions (the default objective first)."""
        return {self.objective: self.direction, **dict(self.objectives)}

    def direction_of(self, objective: str) -> Direction:
        """The direction of `objective`; ValueError naming the allowed ones when the kind does not optimise it."""
        allowed = self.objective_directions()
        if objective not in allowed:
            raise ValueError(f"{objective!r} is not an objective of this kind; allowed: "
                             + ", ".join(f"{k} ({d})" for k, d in allowed.items()))
        return allowed[objective]

    @property
    def headline(self) -> str:
        return to_test(self.objective)

    def base(self, name: str) -> str:
        return f"base_{name}"

    @property
    def headline_set(self) -> tuple[str, ...]:
        """The few metrics every run and every model version leads with, in this order: the headline (test)
        of the adapter, the base model and the baseline side by side, the same on dev (the objective), then
        cost. `test_ndcg@10, base_test_ndcg@10, bm25_test_ndcg@10, dev_ndcg@10, …, cost_wall_s, cost_usd`.
        A run logs those it has (a trial has no test numbers); everything else goes to its metrics table."""
        names: list[str] = []
        for name in (self.headline, self.objective):
            names += [name, self.base(name)] + ([f"{self.baseline}_{name}"] if self.baseline else [])
            names += [f"{self.gate}_{name}"] if self.gate != "base" else []
            names += [f"{r.prefix}_{name}" for r in self.rivals]
        return (*names, *self.beside, *COST_HEADLINE)

    def summary(self, metrics: Mapping[str, float]) -> str | None:
        """The headline in words: `test nDCG@10 0.440 vs base 0.315 (+40 %) and BM25 0.298`; None without it."""
        score = metrics.get(self.headline)
        if score is None:
            return None
        text = f"test {self.label or self.headline.removeprefix('test_')} {_number(score)}"
        base = metrics.get(self.base(self.headline))
        if base is not None:
            text += f" vs base {_number(base)}" + (f" ({(score / base - 1) * 100:+.0f} %)" if base else "")
        other = metrics.get(f"{self.baseline}_{self.headline}") if self.baseline else None
        if other is not None:
            text += f" and {self.baseline_label} {_number(other)}"
        return text

    def rows(self, metrics: Mapping[str, Any], *, model: str = "adapter", step: int | None = None
             ) -> list[dict[str, Any]]:
        """Flat metrics as table rows (name, model, split, metric, step, value): the long tail of a run.

        `base_test_ndcg@10` → model `base`, split `test`, metric `ndcg@10`; a name with no known prefix
        belongs to `model`; a name with no split prefix (`cost_usd`) has split ''."""
        prefixes = ["base"] + ([self.baseline] if self.baseline else [])
        # Longest first: `bestfirst_` is not `best_` + `first_…`.
        prefixes += sorted({p for p, _ in self.gates} - set(prefixes), key=len, reverse=True)
        out = []
        for name, value in metrics.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            who, rest = model, name
            for p in prefixes:
                if name.startswith(p + "_"):
                    who, rest = p, name[len(p) + 1:]
                    break
            split = next((s for s in SPLITS if rest.startswith(s + "_")), "")
            out.append({"name": name, "model": who, "split": split, "metric": rest[len(split) + 1:] if split else rest,
                        "step": step, "value": float(value)})
        return out


def _number(value: float) -> str:
    """0.440 for scores in [0, 1], 41.2 for chrF-like scores in [0, 100]."""
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def beats(score: float, reference: float, margin: float, direction: Direction) -> bool:
    """Whether `score` beats `reference` by the relative `margin` (0.02: by 2 % of the reference).

    A tie is no win: `score` must be strictly better than `reference`, and reach the margin (within rounding:
    0.40 × 1.05 is 0.42000000000000004 in floating point, and 0.42 is enough)."""
    need = abs(reference) * margin
    tol = 1e-9 * max(abs(reference), 1.0)
    if direction == "maximize":
        return score > reference and score >= reference + need - tol
    return score < reference and score <= reference - need + tol


def not_behind(score: float, reference: float, direction: Direction) -> bool:
    """Whether `score` is at least as good as `reference` (the champion test: a version may tie its champion)."""
    tol = 1e-9 * max(abs(reference), 1.0)
    return score >= reference - tol if direction == "maximize" else score <= reference + tol


@dataclass(frozen=True)
class GateResult:
    """A gate's verdict (what promotion acts on): frozen, like every state that decides a promotion."""

    ok: bool
    reasons: list[str]
    score: float | None
    champion_score: float | None
    base_score: float | None
    margin: float
    metric: str
    against: str = "base"  # the prefix base_score was read under: `base`, or `best` (the best baseline)
    rivals: dict[str, float] = field(default_factory=dict)  # MetricSpec.rivals' scores, by prefix
    margin_source: str = ""  # where `margin` came from (promotion: --margin, the bundle, the default)


def judge(metrics: MetricSpec, candidate: Mapping[str, float], champion: Mapping[str, float] | None,
          margin: float, *, candidate_label: str = "the candidate", champion_label: str = "the champion"
          ) -> GateResult:
    """The one quality gate, used by research's verdict and by promotion.

    The candidate's headline metric must beat, by the relative `margin` and strictly (a tie is no win), what
    `metrics.gates` names (the base model, or the kind's best baseline, and each rival), and must not fall
    behind the current champion's. Pure: metric dicts in, a verdict with reasons out.
    """
    name = metrics.headline
    score = candidate.get(name)
    champ = champion.get(name) if champion is not None else None
    references = {prefix: candidate.get(f"{prefix}_{name}") for prefix, _ in metrics.gates}
    reasons: list[str] = []
    if score is None:
        reasons.append(f"{candidate_label} has no {name} recorded, so it cannot be judged")
    else:
        for prefix, label in metrics.gates:
            ref = references[prefix]
            if ref is None:
                reasons.append(f"{candidate_label} has no {prefix}_{name} recorded ({label}'s score)")
            elif not beats(score, ref, margin, metrics.direction):
                reasons.append(shortfall(name, score, ref, margin, metrics.direction, label))
        if champion is not None:
            worse = "below" if metrics.direction == "maximize" else "above"
            if champ is None:
                reasons.append(f"{champion_label} has no {name} recorded to compare with")
            elif not not_behind(score, champ, metrics.direction):
                reasons.append(f"{name} {score:.4f} is {abs(champ - score):.4f} {worse} {champion_label}'s {champ:.4f}")
    rivals = {p: v for p, v in references.items() if p != metrics.gate and v is not None}
    return GateResult(not reasons, reasons, score, champ, references[metrics.gate], margin, name, metrics.gate,
                      rivals)


def shortfall(name: str, score: float, ref: float, margin: float, direction: Direction, label: str) -> str:
    """Why `score` does not beat `ref` by `margin`, in words (a tie says so: it is no win)."""
    if score == ref:
        return f"{name} {score:.4f} ties {label}'s {ref:.4f}: a tie is no win (relative margin {margin:.1%})"
    worse = "below" if direction == "maximize" else "above"
    need = ref + abs(ref) * margin * (1 if direction == "maximize" else -1)
    return (f"{name} {score:.4f} is {abs(need - score):.4f} {worse} what it needs: "
            f"{label}'s {ref:.4f} and a relative margin of {margin:.1%} ({need:.4f})")


class TaskDataset(Protocol):
    """What research needs of a kind's dataset; the rest is the kind's own business."""

    digest: str

    def summary(self) -> dict[str, int]: ...


@dataclass
class TrainResult:
    """One training run of a kind: the adapter and flat metrics (`dev_*` of the last epoch; `test_*` only from a
    standalone `run`, never from `train`)."""

    adapter_dir: Path
    metrics: dict[str, float]
    epochs: list[dict[str, float]]  # per epoch: epoch, train_loss, dev_* metrics
    cost: dict[str, float]  # wall_s, cpu_s, peak_rss_mb, usd
    dataset_digest: str
    report_path: Path | None = None
    extras: dict[str, Any] = field(default_factory=dict)


class TaskKind(ABC):
    """Base class of a task kind; subclasses set the class attributes and implement the abstract methods."""

    name: ClassVar[str]
    capability: ClassVar[str]  # wire.EMBED or wire.GENERATE: what a runtime must offer to serve it
    bundle_kind: ClassVar[str]  # recorded in bundle.yaml: "sentence-transformers", "causal-lm"
    default_runtime: ClassVar[str] = "sentence-transformers"  # the runtime plugin a bundle of this kind names
    metrics: ClassVar[MetricSpec]
    config_model: ClassVar[type[StrictModel]]  # the `train:` section

    def parse_config(self, raw: Mapping[str, Any], source: str = "train:") -> Any:
        return validate_model(self.config_model, dict(raw), source=source)

    def dataset_key(self, cfg: Any) -> str:
        """Trials whose configs give the same key share one dataset (data section and base model by default)."""
        data = getattr(cfg, "data", None)
        return json.dumps([data.model_dump(mode="json") if data is not None else None,
                           getattr(cfg, "base_model", None)], sort_keys=True, default=str)

    def baseline_key(self, cfg: Any) -> str:
        """Configs with the same key have the same `baselines`: research computes them once per key and judges a
        winner against those of its own key (its data, base model, and whatever else they depend on). By
        default the dataset's key; a kind whose baselines depend on more (rerank: the first stage) adds it."""
        return self.dataset_key(cfg)

    def rivals(self, cfg: Any, dataset: Any, variants: Sequence[Any]) -> dict[str, float]:
        """The `metrics.rivals` scores for `cfg` on `dataset`, on dev and test (`<prefix>_{split}_{metric}`), given
        `variants`: `cfg` under the other choices its research space holds (empty outside research). None by
        default."""
        return {}

    def base_source(self, cfg: Any) -> str:
        return str(cfg.base_model)

    def base_name(self, cfg: Any) -> str:
        """The fleet base a bundle of this kind runs on (bundle.yaml `base.name`, what promotion looks for)."""
        from lorafleet.core.model_source import base_name_for

        return base_name_for(self.base_source(cfg))

    @abstractmethod
    def build_dataset(self, cfg: Any) -> TaskDataset: ...

    @abstractmethod
    def baselines(self, cfg: Any, dataset: Any) -> dict[str, float]:
        """The base model's and the non-learned baseline's metrics on dev and test, prefixed `base_`/`<baseline>_`."""

    @abstractmethod
    def train(self, cfg: Any, dataset: Any, out_dir: Path, *, on_epoch: EpochCallback | None = None
              ) -> TrainResult:
        """Train one adapter and score it on dev only: test is for the winner, through `evaluate`."""

    @abstractmethod
    def evaluate(self, cfg: Any, dataset: Any, adapter_dir: Path, split: str) -> dict[str, float]:
        """The adapter's metrics on `split`, named `{split}_{metric}` (no prefix)."""

    @abstractmethod
    def run(self, cfg: Any, out_dir: Path | None = None, *, log_mlflow: bool = True,
            run_name: str | None = None) -> TrainResult:
        """One standalone training run (`lorafleet train`): dataset, baselines, LoRA, evaluation, report, MLflow."""

    def bundle_details(self, cfg: Any) -> dict[str, Any]:
        """What a bundle of this kind records beside the adapter (pooling, chat template, …); none by default."""
        return {}

    def gate(self, candidate: Mapping[str, float], champion: Mapping[str, float] | None, margin: float,
             **labels: str) -> GateResult:
        return judge(self.metrics, candidate, champion, margin, **labels)

    def base_metrics(self, base: Mapping[str, float]) -> dict[str, float]:
        return prefixed(base, "base")


def get_task_kind(name: str) -> TaskKind:
    """The task kind registered as `name` (entry-point group `lorafleet.tasks`)."""
    kind = plugins.load(plugins.TASK_KINDS, name)
    instance = kind() if isinstance(kind, type) else kind
    if not isinstance(instance, TaskKind):
        raise plugins.PluginError(f"task kind {name!r} is {type(instance).__name__}, not a lorafleet TaskKind")
    return instance


def task_kind_names() -> list[str]:
    return plugins.names(plugins.TASK_KINDS)
