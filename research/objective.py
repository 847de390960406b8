"""One Optuna trial = one LoRA training by train/, tracked as one nested MLflow run.

Each epoch's dev metrics go to MLflow (with the epoch as step) and the objective to the pruner;
a pruned, failed or timed-out trial ends its MLflow run with the matching state and reason.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import optuna

from lorafleet.core.metrics import prefixed
from lorafleet.core.tasks import TaskKind

from .config import LoadedConfig, apply_params
from .progress import Progress
from .study import ATTR_ADAPTER_ARTIFACT, decode_params, retry_trial, suggest, worker_id
from .tracking import ADAPTER_ARTIFACT, Tracker


def _time_limit_in(exc: BaseException) -> TrialTimeout | None:
    """The TrialTimeout that `exc` is or wraps (its cause or context chain), if any."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, TrialTimeout):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


class TrialTimeout(Exception):
    """A trial ran past its time limit (per-trial limit or what was left of the budget)."""


class DatasetCache:
    """Trials whose configs give the same `kind.dataset_key` share one dataset (built once per process)."""

    def __init__(self, kind: TaskKind) -> None:
        self.kind = kind
        self._cache: dict[str, Any] = {}

    def get(self, cfg: Any) -> Any:
        key = self.kind.dataset_key(cfg)
        if key not in self._cache:
            self._cache[key] = self.kind.build_dataset(cfg)
        return self._cache[key]

    def cached(self, cfg: Any) -> Any | None:
        """The dataset if it was built already (what a trial that failed early may lack)."""
        return self._cache.get(self.kind.dataset_key(cfg))


_FINALISER_CODE = frozenset({"__del__", "unraisable_hook"})
_FINALISER_FILES = ("unraisableexception.py", "tracemalloc.py", "weakref.py", "_weakrefset.py")


def _in_finaliser(frame: FrameType | None) -> bool:
    """Whether the interrupted code is a finaliser, a weakref callback or the unraisable hook (any frame up)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in _FINALISER_CODE or code.co_filename.endswith(_FINALISER_FILES):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise TrialTimeout inside the block after `seconds` (SIGALRM: main thread only, else epoch checks).

    The alarm repeats every second until the block is left: an exception raised while Python runs a
    finaliser or a GC callback is swallowed, and the next alarm then lands in ordinary code.
    """
    usable = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    if not usable or seconds <= 0:
        yield
        return

    def _alarm(signum: int, frame: FrameType | None) -> None:
        if _in_finaliser(frame):
            return  # raised there it is swallowed (or breaks sys.unraisablehook); the next alarm lands elsewhere
        raise TrialTimeout(f"time limit of {seconds:.0f}s reached")

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def metrics_of(result: Any) -> dict[str, float]:
    return dict(getattr(result, "metrics", None) or (result.get("metrics") if isinstance(result, dict) else {}))


@dataclass
class TrialObjective:
    loaded: LoadedConfig
    kind: TaskKind
    tracker: Tracker
    parent_run_id: str
    trials_dir: Path
    deadline: float  # time.monotonic() when this process's budget ends
    progress: Progress
    datasets: DatasetCache
    baseline: dict[str, float] = field(default_factory=dict)
    counted: Callable[[], int] = lambda: 0

    def __call__(self, trial: optuna.Trial) -> float:
        cfg = self.loaded.research
        objective = self.loaded.objective
        retry_of = trial.user_attrs.get("retry_of")
        params = suggest(trial, cfg.space)
        trial.set_user_attr("worker", worker_id())
        train_cfg = apply_params(self.loaded.train_raw, params, self.kind.config_model)
        run_id = self.tracker.start_trial(self.parent_run_id, trial.number, trial.params, retry_of)
        trial.set_user_attr("mlflow_run_id", run_id)
        self.progress.trial_started(trial.number, self.counted(), params)

        limit = min(cfg.trial_timeout_minutes * 60, self.deadline - time.monotonic())
        started, cpu0 = time.monotonic(), time.process_time()
        spec = self.kind.metrics
        table: list[dict[str, Any]] = []  # every number of this trial: its MLflow table artifact

        def on_epoch(epoch: int, metrics: dict[str, float]) -> None:
            # MLflow gets the objective per epoch (the pruning curve); the other dev metrics go to the table.
            self.tracker.log_metrics(run_id, {objective: metrics[objective]}, step=epoch)
            table.extend(spec.rows(metrics, step=epoch))
            value = float(metrics[objective])
            trial.report(value, epoch)
            self.progress.epoch(trial.number, epoch, value)
            # After the last epoch the trial is done: pruning it would discard a finished result and save nothing.
            if epoch < train_cfg.epochs and trial.should_prune():
                raise optuna.TrialPruned(f"pruned after epoch {epoch}: {objective}={value:.4f}")
            if time.monotonic() - started > limit:
                raise TrialTimeout(f"time limit of {limit:.0f}s reached after epoch {epoch}")

        def record_cost(extra: dict[str, float] | None = None) -> dict[str, float]:
            """Cost (headline) and the trial's table, with the dataset it ran on: every way a trial ends."""
            cost = {"cost_wall_s": time.monotonic() - started, "cost_cpu_s": time.process_time() - cpu0}
            trial.set_user_attr("wall_s", round(cost["cost_wall_s"], 3))
            trial.set_user_attr("cpu_s", round(cost["cost_cpu_s"], 3))
            self.tracker.log_headline(run_id, {**cost, **(extra or {})}, spec)
            self.tracker.log_table(run_id, table + spec.rows({**cost, **(extra or {})}))
            dataset = self.datasets.cached(train_cfg)
            if dataset is not None:
                self.tracker.log_dataset(run_id, dataset, self.loaded.task)
            return cost

        out_dir = self.trials_dir / f"trial-{trial.number:03d}"
        try:
            if limit <= 0:
                raise TrialTimeout("no budget left for this trial")
            with time_limit(limit):
                result = self.kind.train(train_cfg, self.datasets.get(train_cfg), out_dir, on_epoch=on_epoch)
        except optuna.TrialPruned as exc:
            record_cost()
            self.tracker.finish_trial(run_id, "pruned", str(exc))
            self.progress.trial_finished(trial.number, "pruned", None, self._best(trial), str(exc))
            raise
        except BaseException as exc:  # KeyboardInterrupt too: the run must not stay RUNNING in MLflow
            # The time-limit alarm fires wherever the trial is; a library that wraps what it catches (MLflow
            # committing a metric) must not hide that the limit ended the trial.
            cause = _time_limit_in(exc) or exc
            reason = f"{type(cause).__name__}: {cause}"
            if isinstance(exc, KeyboardInterrupt):
                reason = "interrupted (Ctrl-C); configuration queued again for `research resume`"
                with contextlib.suppress(Exception):
                    retry_trial(trial.study, trial.study._storage.get_trial(trial._trial_id),
                                self.loaded.research.max_retries)
            trial.set_user_attr("fail_reason", reason[:1000])
            with contextlib.suppress(Exception):
                record_cost()
                self.tracker.finish_trial(run_id, "failed", reason)
            self.progress.trial_finished(trial.number, "failed", None, self._best(trial), reason[:200])
            raise

        metrics = metrics_of(result)
        if objective not in metrics:
            raise KeyError(f"train_adapter returned no {objective!r} (got {sorted(metrics)})")
        value = float(metrics[objective])
        # The final dev metrics are the last epoch's, already logged by on_epoch at that step; what the kind
        # measured beside them (training cost, sizes) goes to the table. A trial never sees test: the kind's
        # `train` scores dev only, and test numbers a kind returns anyway are dropped, unread (winner only).
        train_cost = dict(getattr(result, "cost", None) or {})
        extra = {k: v for k, v in metrics.items() if not k.startswith(("test_", "dev_"))}
        extra.update(prefixed(train_cost, "train_cost"))
        if "usd" in train_cost:
            extra["cost_usd"] = train_cost["usd"]
        cost = record_cost(extra)
        adapter_dir = str(getattr(result, "adapter_dir", out_dir))
        # The adapter goes to the trial's MLflow run too: the process that picks the winner may run on another
        # machine (a shared study on PostgreSQL) and takes it from there, not from this machine's disk.
        self.tracker.log_artifacts(run_id, Path(adapter_dir), ADAPTER_ARTIFACT)
        trial.set_user_attr("adapter_dir", adapter_dir)
        trial.set_user_attr(ATTR_ADAPTER_ARTIFACT, ADAPTER_ARTIFACT)
        trial.set_user_attr("dataset_digest", getattr(result, "dataset_digest", "") or "")
        trial.set_user_attr("dev_metrics", {k: float(v) for k, v in metrics.items() if k.startswith("dev_")})
        self.tracker.set_tags(run_id, {"lorafleet.adapter_dir": adapter_dir,
                                       "lorafleet.dataset_digest": getattr(result, "dataset_digest", "")})
        self.tracker.finish_trial(run_id, "complete")
        self.progress.trial_finished(trial.number, "complete", value, self._best(trial, value),
                                     f"{cost['cost_wall_s']:.0f}s")
        return value

    def _best(self, trial: optuna.Trial, value: float | None = None) -> tuple[int, float] | None:
        sign = 1.0 if self.kind.metrics.direction_of(self.loaded.objective) == "maximize" else -1.0
        best: tuple[int, float] | None = None
        for t in trial.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            if t.value is not None and (best is None or sign * t.value > sign * best[1]):
                best = (t.number, t.value)
        if value is not None and (best is None or sign * value > sign * best[1]):
            best = (trial.number, value)
        return best


def decoded_params(loaded: LoadedConfig, trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    return decode_params(loaded.research.space, trial.params)
