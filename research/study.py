"""The Optuna side: storage, study creation with a search-space fingerprint, samplers, pruners,
and recovery of trials whose process died.

Storage is Optuna's RDB storage: sqlite under LORAFLEET_HOME by default, PostgreSQL
(`postgresql+psycopg://user:pw@host:5432/db`, driver from the `postgres` extra) or any SQLAlchemy URL
with `--storage` when several machines drive one study. RDB storage is the one
with heartbeats in Optuna 5, which is how a trial on a dead machine is noticed and retried.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import optuna
import psutil
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.exc import SQLAlchemyError

from lorafleet.core import settings
from lorafleet.core.config import ConfigError

from .config import (
    CategoricalParam,
    FloatParam,
    IntParam,
    PrunerConfig,
    ResearchConfig,
    SamplerConfig,
    space_fingerprint,
)

ATTR_FINGERPRINT = "space_fingerprint"
ATTR_CONFIG = "config"
ATTR_PARENT_RUN = "mlflow_parent_run_id"
ATTR_BASELINE = "baseline"
ATTR_JUDGED = "judged_baseline"  # `judged_baseline:<key hash>`: what a winner of that baseline key is judged against
ATTR_FINALIZE_CLAIM = "finalize_claim"
ATTR_FINALIZED = "finalized"
ATTR_ADAPTER_ARTIFACT = "adapter_artifact"  # trial attr: the artifact path of its adapter in its MLflow run
ATTR_UID = "uid"  # a random id made with the study: a study deleted and made again under its name gets another
TEST_RECORD = "test:"  # study attrs `test:{uid}:{dataset digest}`: the one look at test (see finalize)

optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


class StudyError(ConfigError):
    """A study that cannot be created, loaded or continued as asked."""


def default_storage_url() -> str:
    folder = settings.home() / "optuna"
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'optuna.db'}"


def storage_url(explicit: str | None = None) -> str:
    return explicit or os.environ.get("LORAFLEET_OPTUNA_STORAGE") or default_storage_url()


def make_storage(url: str, cfg: ResearchConfig,
                 on_stale: Callable[[optuna.Study, FrozenTrial], None] | None) -> optuna.storages.RDBStorage:
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # Several local processes share one file; wait for the lock instead of failing at once.
        engine_kwargs["connect_args"] = {"timeout": 60}
    else:
        engine_kwargs["pool_pre_ping"] = True
    # Processes on other machines start together against one fresh database and race to create Optuna's
    # tables (PostgreSQL: a duplicate key in pg_type); the loser finds them made on its next try.
    attempts = 1 if url.startswith("sqlite") else 4
    for attempt in range(1, attempts + 1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats: "experimental"
            try:
                return optuna.storages.RDBStorage(
                    url, engine_kwargs=engine_kwargs, heartbeat_interval=cfg.heartbeat_s,
                    grace_period=cfg.grace_s, heartbeat_stale_trial_callback=on_stale,
                )
            except ImportError as exc:  # Optuna wraps the driver's ModuleNotFoundError; name what to install
                raise StudyError(missing_driver(url, exc)) from exc
            except SQLAlchemyError as exc:
                if attempt == attempts:
                    raise StudyError(f"cannot open Optuna storage {redact(url)}: {type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0]}") from exc
                time.sleep(attempt)
    raise AssertionError("unreachable")  # the loop returns or raises


def missing_driver(url: str, exc: ImportError) -> str:
    """What to install when the database driver of a storage URL cannot be imported."""
    module = getattr(exc.__cause__, "name", None) or exc.name or "its database driver"
    where = f"Optuna storage {redact(url)} needs {module}, which is not installed"
    if url.split(":", 1)[0].split("+", 1)[0] == "postgresql":
        return (f"{where}: install lorafleet's postgres extra (pip install 'lorafleet[postgres]', psycopg 3) and "
                "use postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB")
    return f"{where}: install that driver into lorafleet's environment"


def make_sampler(cfg: SamplerConfig, seed_offset: int = 0) -> optuna.samplers.BaseSampler:
    seed = cfg.seed + seed_offset
    if cfg.kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=cfg.n_startup_trials)


def make_pruner(cfg: PrunerConfig) -> optuna.pruners.BasePruner:
    if cfg.kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=cfg.n_startup_trials, n_warmup_steps=cfg.n_warmup_steps)
    if cfg.kind == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=cfg.min_resource,
                                                      reduction_factor=cfg.reduction_factor)
    if cfg.kind == "threshold":
        return optuna.pruners.ThresholdPruner(lower=cfg.lower, n_warmup_steps=cfg.n_warmup_steps)
    return optuna.pruners.NopPruner()


def suggest(trial: optuna.Trial, space: dict[str, Any]) -> dict[str, Any]:
    """Sample every parameter; returns TrainConfig values (categorical labels decoded)."""
    params: dict[str, Any] = {}
    for path, spec in space.items():
        if isinstance(spec, IntParam):
            params[path] = trial.suggest_int(path, spec.low, spec.high, step=spec.step, log=spec.log)
        elif isinstance(spec, FloatParam):
            params[path] = trial.suggest_float(path, spec.low, spec.high, step=spec.step, log=spec.log)
        elif isinstance(spec, CategoricalParam):
            params[path] = spec.decode(trial.suggest_categorical(path, spec.labels()))
        else:  # pragma: no cover - the discriminated union has three members
            raise TypeError(spec)
    return params


def decode_params(space: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for path, value in raw.items():
        spec = space.get(path)
        out[path] = spec.decode(value) if isinstance(spec, CategoricalParam) else value
    return out


def worker_id() -> str:
    """host:pid:start-time; the start time tells a reused pid from the original process."""
    proc = psutil.Process()
    return f"{socket.gethostname()}:{proc.pid}:{proc.create_time():.2f}"


def _worker_alive(worker: str) -> bool | None:
    """True/False for a worker on this host, None when it ran elsewhere (only heartbeats can tell)."""
    try:
        host, pid_s, created_s = worker.rsplit(":", 2)
        pid, created = int(pid_s), float(created_s)
    except ValueError:
        return None
    if host != socket.gethostname():
        return None
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - created) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def open_study(name: str, storage: optuna.storages.BaseStorage, cfg: ResearchConfig, snapshot: dict[str, Any], *,
               must_exist: bool = False, seed_offset: int | None = None, direction: str = "maximize"
               ) -> tuple[optuna.Study, bool]:
    """Create the study, or load it and check it searches the same space. Returns (study, created)."""
    fingerprint = space_fingerprint(cfg.space)
    pruner = make_pruner(cfg.pruner)
    created = False
    if must_exist:
        try:
            study = optuna.load_study(study_name=name, storage=storage, pruner=pruner)
        except KeyError as exc:
            raise StudyError(f"no study named {name!r} in {_describe(storage)}; start it with `research run`") \
                from exc
    else:
        try:
            study = optuna.create_study(study_name=name, storage=storage, direction=direction, pruner=pruner)
            study.set_user_attr(ATTR_UID, uuid.uuid4().hex)  # before the fingerprint others wait for
            study.set_user_attr(ATTR_CONFIG, snapshot)
            study.set_user_attr(ATTR_FINGERPRINT, fingerprint)
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(study_name=name, storage=storage, pruner=pruner)
    if not created:
        stored = _wait_for_attr(study, ATTR_FINGERPRINT, timeout_s=30.0)
        if stored is None:
            raise StudyError(f"study {name!r} exists but was not created by lorafleet (no search-space fingerprint)")
        if stored != fingerprint:
            raise StudyError(
                f"study {name!r} already exists with a different search space (fingerprint {stored}, "
                f"this config {fingerprint}); pick another --study name or use the same research.space"
            )
    if seed_offset is None:
        # A continued study must not replay the random start-up samples it already tried.
        seed_offset = len(study.get_trials(deepcopy=False))
        if not created:
            seed_offset += os.getpid()
    study.sampler = make_sampler(cfg.sampler, seed_offset)
    return study, created


def redact(url: str) -> str:
    """The storage URL without its password, for messages and MLflow tags."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("@")[-1]


def _describe(storage: optuna.storages.BaseStorage) -> str:
    return redact(getattr(storage, "url", "storage"))


def _wait_for_attr(study: optuna.Study, key: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = study._storage.get_study_user_attrs(study._study_id).get(key)
        if value is not None or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def study_attr(study: optuna.Study, key: str) -> Any:
    # Read fresh from storage: other processes may have written since this study object was loaded.
    return study._storage.get_study_user_attrs(study._study_id).get(key)


def study_uid(study: optuna.Study) -> str:
    """The study's id: made with it, or for a study from before ids its row number in the storage."""
    return str(study_attr(study, ATTR_UID) or f"optuna-{study._study_id}")


def tested_key(uid: str, digest: str) -> str:
    """The study attr recording the one evaluation on test: keyed by study id and dataset digest, so a record
    never speaks for another study of the same name or for numbers measured on other data."""
    return f"{TEST_RECORD}{uid}:{digest}"


def tested_records(study: optuna.Study) -> dict[str, dict[str, Any]]:
    """This study's records of its look at test (at most one is ever written), by key."""
    prefix = TEST_RECORD + study_uid(study) + ":"
    attrs = study._storage.get_study_user_attrs(study._study_id)
    return {k: v for k, v in attrs.items() if k.startswith(prefix) and isinstance(v, dict)}


def retry_trial(study: optuna.Study, trial: FrozenTrial, max_retries: int) -> bool:
    """Queue the interrupted trial's configuration again (same params), unless retried too often."""
    history = [*trial.system_attrs.get("retry_history", []), trial.number]
    if len(history) > max_retries:
        return False
    study.add_trial(optuna.trial.create_trial(
        state=TrialState.WAITING, params=trial.params, distributions=trial.distributions,
        user_attrs={"retry_of": trial.number},
        system_attrs={"failed_trial": history[0], "retry_history": history},
    ))
    return True


def recover_dead_local_trials(study: optuna.Study, on_interrupted: Callable[[optuna.Study, FrozenTrial], None]
                              ) -> list[int]:
    """Fail RUNNING trials whose process on this host is gone (no need to wait for the heartbeat grace)."""
    recovered = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker")
        if worker is None or _worker_alive(worker) is not False:
            continue
        try:
            study._storage.set_trial_user_attr(t._trial_id, "fail_reason", "interrupted: its process died")
            if not study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another process got there first
        on_interrupted(study, study._storage.get_trial(t._trial_id))
        recovered.append(t.number)
    return recovered


def fail_stale(study: optuna.Study) -> None:
    """Heartbeat check for trials of dead processes anywhere (calls the storage's stale callback)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def retried_numbers(trials: list[FrozenTrial]) -> set[int]:
    return {n for t in trials for n in t.system_attrs.get("retry_history", [])}


def counted_trials(study: optuna.Study) -> int:
    """Trials that count against n_trials: finished, running, or failed for a reason other than a kill."""
    trials = study.get_trials(deepcopy=False)
    retried = retried_numbers(trials)
    counted = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    return sum(1 for t in trials if t.state in counted or (t.state == TrialState.FAIL and t.number not in retried))


def trials_table(study: optuna.Study, space: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        rows.append({
            "number": t.number, "state": t.state.name.lower(), "value": t.value,
            "params": decode_params(space, t.params), "retry_of": t.user_attrs.get("retry_of"),
            "wall_s": t.user_attrs.get("wall_s"), "cpu_s": t.user_attrs.get("cpu_s"),
            "epochs_run": len(t.intermediate_values), "reason": t.user_attrs.get("fail_reason"),
        })
    return rows


def jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def trial_counts(study: optuna.Study) -> dict[str, int]:
    """Trials by state (complete, pruned, fail, running, waiting)."""
    out: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        out[t.state.name.lower()] = out.get(t.state.name.lower(), 0) + 1
    return out


def winner_of(study: optuna.Study) -> FrozenTrial | None:
    """The best complete trial in the study's direction; ties go to the earlier trial."""
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    if not complete:
        return None
    sign = 1.0 if study.direction == optuna.study.StudyDirection.MAXIMIZE else -1.0
    return max(complete, key=lambda t: (sign * float(t.value), -t.number))  # type: ignore[arg-type]
