"""The `research:` section: search space, sampler, pruner, budgets, and how a winner is judged.

The search space is declarative: each entry maps a dotted path into `TrainConfig` (`lora.r`,
`learning_rate`, `data.hard_negatives`, …) to a range or a list of choices. Paths are checked
against the TrainConfig model, so a typo fails before any training starts.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from lorafleet.core.config import ConfigError, StrictModel, apply_overrides, read_yaml, validate_model
from lorafleet.core.plugins import PluginError
from lorafleet.core.tasks import DEFAULT_MARGIN, TaskKind, get_task_kind

STUDY_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


def _check_range(low: float, high: float, bad_log: bool, log_rule: str) -> None:
    """A numeric parameter's range: low must not exceed high; `bad_log`: its log sampling breaks `log_rule`."""
    if low > high:
        raise ValueError(f"low ({low}) must not exceed high ({high})")
    if bad_log:
        raise ValueError(log_rule)


class IntParam(StrictModel):
    type: Literal["int"]
    low: int
    high: int
    step: int = Field(1, ge=1)
    log: bool = False

    @model_validator(mode="after")
    def _check(self) -> IntParam:
        _check_range(self.low, self.high, self.log and (self.low < 1 or self.step != 1),
                     "log=true needs low >= 1 and step 1")
        return self

    def bounds(self) -> list[Any]:
        return [self.low, self.high]


class FloatParam(StrictModel):
    type: Literal["float"]
    low: float
    high: float
    step: float | None = Field(None, gt=0)
    log: bool = False

    @model_validator(mode="after")
    def _check(self) -> FloatParam:
        _check_range(self.low, self.high, self.log and (self.low <= 0 or self.step is not None),
                     "log=true needs low > 0 and no step")
        return self

    def bounds(self) -> list[Any]:
        return [self.low, self.high]


class CategoricalParam(StrictModel):
    type: Literal["categorical"]
    choices: list[Any] = Field(min_length=1)

    def bounds(self) -> list[Any]:
        return list(self.choices)

    def labels(self) -> list[str | int | float | bool | None]:
        """Optuna stores only scalars; lists (e.g. target modules) travel as their JSON text."""
        return [c if c is None or isinstance(c, str | int | float | bool) else json.dumps(c) for c in self.choices]

    def decode(self, label: Any) -> Any:
        for choice, lab in zip(self.choices, self.labels(), strict=True):
            if lab == label:
                return choice
        raise ValueError(f"{label!r} is not among the choices {self.choices}")


ParamSpec = Annotated[IntParam | FloatParam | CategoricalParam, Field(discriminator="type")]


class SamplerConfig(StrictModel):
    kind: Literal["tpe", "random"] = "tpe"
    seed: int = 0
    n_startup_trials: int = Field(5, ge=0, description="TPE: random trials before the model kicks in.")


class PrunerConfig(StrictModel):
    """Stops weak trials early, fed each epoch's dev objective."""

    kind: Literal["median", "successive_halving", "threshold", "none"] = "median"
    n_startup_trials: int = Field(2, ge=0, description="median: trials that run fully before pruning starts.")
    n_warmup_steps: int = Field(0, ge=0, description="median: epochs reported before a trial can be pruned.")
    min_resource: int = Field(1, ge=1, description="successive_halving: epochs before the first rung.")
    reduction_factor: int = Field(3, ge=2, description="successive_halving: keep 1 in this many per rung.")
    lower: float | None = Field(None, description="threshold: prune when the epoch's objective is below this.")

    @model_validator(mode="after")
    def _check(self) -> PrunerConfig:
        if self.kind == "threshold" and self.lower is None:
            raise ValueError("pruner kind 'threshold' needs 'lower'")
        return self


class ResearchConfig(StrictModel):
    study: str = Field("lorafleet", pattern=STUDY_NAME_PATTERN, description="Optuna study and MLflow experiment name.")
    space: dict[str, ParamSpec] = Field(description="TrainConfig dotted path -> range or choices.")
    n_trials: int = Field(20, ge=1, description="Trials to finish (complete or pruned), counted over the whole study.")
    budget_minutes: float = Field(60.0, gt=0, description="Wall-clock budget of one `run` or `resume` invocation.")
    trial_timeout_minutes: float = Field(30.0, gt=0, description="A trial running longer fails ('time limit').")
    objective: str | None = Field(None, description="Dev metric that is optimised; default: the task kind's "
                                  "(dev_ndcg@10 for retrieval). Only one its kind declares an objective, in the "
                                  "direction it declares.")
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    pruner: PrunerConfig = Field(default_factory=PrunerConfig)
    min_margin: float = Field(
        DEFAULT_MARGIN, ge=0, description="Winner must beat what its kind's gate compares with (the base model, or "
        "its best baseline) on dev and test by this relative margin, strictly (a tie is no win); the bundle records "
        "it and promotion gates at it."
    )
    reseed: bool = Field(True, description="Re-train the winner with a second seed and report the spread.")
    start_from_config: bool = Field(
        True, description="A new study's first trial trains the `train:` section as written (its values of the "
        "searched parameters, where the space holds them), so research never ends below the config it searches around."
    )
    heartbeat_s: int = Field(10, ge=1, description="Trial heartbeat to the study storage.")
    grace_s: int = Field(60, ge=2, description="A RUNNING trial without heartbeat this long is failed and retried.")
    max_retries: int = Field(2, ge=0, description="How often an interrupted trial's configuration is retried.")

    @field_validator("space", mode="before")
    @classmethod
    def _flatten(cls, space: Any) -> Any:
        """`{lora: {r: {...}}}` (as `--set research.space.lora.r=…` writes it) means `{"lora.r": {...}}`."""
        if not isinstance(space, dict):
            return space
        flat: dict[str, Any] = {}

        def walk(prefix: str, node: Any) -> None:
            if isinstance(node, dict) and "type" not in node and (node or not prefix):
                for k, v in node.items():
                    walk(f"{prefix}{k}.", v)
            else:
                flat[prefix[:-1]] = node

        walk("", space)
        return flat

    @model_validator(mode="after")
    def _check(self) -> ResearchConfig:
        if not self.space:
            raise ValueError("search space is empty: add at least one parameter under research.space")
        if self.grace_s <= self.heartbeat_s:
            raise ValueError("grace_s must be larger than heartbeat_s")
        if self.objective is not None and not self.objective.startswith("dev_"):
            raise ValueError(f"objective {self.objective!r} must be a dev metric (dev_…); test is kept for the winner")
        return self


def space_fingerprint(space: dict[str, Any]) -> str:
    """Stable hash of the search space; a study refuses to continue with a different one."""
    raw = {k: (v.model_dump() if isinstance(v, BaseModel) else v) for k, v in sorted(space.items())}
    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside `X`, `X | None`, `Annotated[X | Y, …]` (the first one found), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


def _field_model(model: type[BaseModel], path: str) -> None:
    """Raise ConfigError unless `path` names a field of `model` (descending into nested models)."""
    node: Any = model
    parts = path.split(".")
    for i, part in enumerate(parts):
        fields = getattr(node, "model_fields", None)
        if fields is None or part not in fields:
            where = ".".join(parts[:i]) or "TrainConfig"
            known = sorted(fields) if fields else []
            raise ConfigError(f"research.space: unknown parameter {path!r} ({part!r} is not a field of {where}; "
                              f"fields: {', '.join(known)})")
        node = _nested_model(fields[part].annotation)
    if node is not None:
        raise ConfigError(f"research.space: {path!r} is a section; name one of its fields")


def set_path(raw: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def apply_params(train_raw: dict[str, Any], params: dict[str, Any], train_model: type[StrictModel]) -> Any:
    """A TrainConfig from the base `train:` section with the trial's (decoded) params applied."""
    raw = json.loads(json.dumps(train_raw))
    for path, value in params.items():
        set_path(raw, path, value)
    return validate_model(train_model, raw, source="trial configuration")


def config_point(space: dict[str, Any], train_cfg: BaseModel) -> tuple[dict[str, Any], list[str]]:
    """The config's own value of each searched parameter, as Optuna stores it (categorical labels), and the paths
    whose value lies outside the space (those a first trial must sample). `train_cfg` is the validated `train:`."""
    point: dict[str, Any] = {}
    outside: list[str] = []
    for path, spec in space.items():
        node: Any = train_cfg
        for part in path.split("."):
            node = getattr(node, part)
        value = node.model_dump(mode="json") if isinstance(node, BaseModel) else node
        if isinstance(spec, CategoricalParam):
            labels = [lab for choice, lab in zip(spec.choices, spec.labels(), strict=True) if choice == value]
            if labels:
                point[path] = labels[0]
            else:
                outside.append(path)
        elif _on_grid(spec, value):
            point[path] = int(value) if isinstance(spec, IntParam) else float(value)
        else:
            outside.append(path)
    return point, outside


def _on_grid(spec: IntParam | FloatParam, value: Any) -> bool:
    """Whether Optuna could sample `value` from this range: a number within the bounds, on the step if any."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not spec.low <= value <= spec.high:
        return False
    if isinstance(spec, IntParam) and not float(value).is_integer():
        return False
    if spec.step is None:
        return True
    steps = (value - spec.low) / spec.step
    return abs(steps - round(steps)) < 1e-9


MAX_VARIANTS = 512  # beyond this many combinations of choices, variants change one parameter at a time


def space_variants(space: dict[str, Any], train_raw: dict[str, Any], params: dict[str, Any],
                   train_model: type[StrictModel]) -> list[Any]:
    """The config of `params` (a trial's, decoded) under the other choices of the space's categorical parameters
    (ranges keep the trial's value): every combination, or one parameter at a time past MAX_VARIANTS. What a kind's
    rivals are drawn from (rerank: the first stages the space holds). Invalid combinations are left out."""
    choices = {path: spec.choices for path, spec in space.items() if isinstance(spec, CategoricalParam)}
    if not choices:
        return []
    points: list[dict[str, Any]]
    if math.prod(len(c) for c in choices.values()) <= MAX_VARIANTS:
        points = [dict(zip(choices, combo, strict=True)) for combo in itertools.product(*choices.values())]
    else:
        points = [{path: value} for path, values in choices.items() for value in values]
    out = []
    for point in points:
        try:
            out.append(apply_params(train_raw, {**params, **point}, train_model))
        except ConfigError:
            continue
    return out


def validate_space(space: dict[str, Any], train_raw: dict[str, Any], train_model: type[StrictModel]) -> None:
    """Every path must be a TrainConfig field, and each bound/choice must make a valid TrainConfig."""
    for path, spec in space.items():
        _field_model(train_model, path)
        for value in spec.bounds():
            try:
                apply_params(train_raw, {path: value}, train_model)
            except ConfigError as exc:
                raise ConfigError(f"research.space.{path}: value {value!r} is not accepted by TrainConfig:\n{exc}") \
                    from exc


DEFAULT_TASK = "retrieval"


class LoadedConfig(BaseModel):
    """A research config: the task kind, the raw `train:` section it searches around, and `research:`.

    `research.objective` is always set here (the task kind's when the file names none).
    """

    task: str = DEFAULT_TASK
    research: ResearchConfig
    train_raw: dict[str, Any]
    source: str

    @property
    def objective(self) -> str:
        assert self.research.objective is not None
        return self.research.objective


def load_config(path: str | Path, overrides: list[str] | None = None) -> LoadedConfig:
    """Read `task:` (default retrieval), `train:` and `research:` from a YAML file, apply `--set` overrides,
    validate all three."""
    path = Path(path)
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a mapping with 'train:' and 'research:' sections")
    raw = apply_overrides(raw, list(overrides or []))
    for section in ("train", "research"):
        if section not in raw:
            raise ConfigError(f"{path} has no top-level '{section}:' section")
    unknown = sorted(set(raw) - {"task", "train", "research"})
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key(s) {unknown}; expected task, train and research")
    return from_raw(raw["train"] or {}, raw["research"] or {}, str(path), raw.get("task") or DEFAULT_TASK)


def task_kind(name: str) -> TaskKind:
    """The task kind `name`, or a ConfigError listing the installed ones."""
    try:
        return get_task_kind(name)
    except PluginError as exc:
        raise ConfigError(f"task: {exc}") from exc


def from_raw(train_raw: dict[str, Any], research_raw: dict[str, Any], source: str, task: str = DEFAULT_TASK
             ) -> LoadedConfig:
    kind = task_kind(task)
    research = validate_model(ResearchConfig, research_raw, source=f"{source} (research:)")
    if research.objective is None:
        research = research.model_copy(update={"objective": kind.metrics.objective})
    elif research.objective not in kind.metrics.objective_directions():
        allowed = ", ".join(f"{k} ({d})" for k, d in kind.metrics.objective_directions().items())
        raise ConfigError(f"{source} (research:): objective {research.objective!r} is not an objective of the {task} "
                          f"kind (a score of the adapter it may be chosen by); allowed: {allowed}")
    validate_model(kind.config_model, train_raw, source=f"{source} (train:)")
    validate_space(research.space, train_raw, kind.config_model)
    return LoadedConfig(task=task, research=research, train_raw=train_raw, source=source)
