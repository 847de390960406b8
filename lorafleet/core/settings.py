"""Where lorafleet keeps its state on one machine, and the environment it reads."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

# MLflow phones home and starts job runners unless told not to; set before anything imports it.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")


class DataDirError(RuntimeError):
    """The dataset folder is missing or does not hold what lorafleet expects."""


# The home: one user-level folder that every command finds from any directory. XDG's data home, because what
# lives there is data a user keeps (the MLflow registry and runs, Optuna studies, the statutes, credentials),
# not a cache: `$XDG_DATA_HOME/lorafleet`, else `~/.local/share/lorafleet`. LORAFLEET_HOME moves it.
HOME_ENV = "LORAFLEET_HOME"
LEGACY_HOME = ".lorafleet"  # the default before: relative to wherever a command ran
# What a home holds (any one of them marks a folder as lorafleet's, not some other tool's `.lorafleet`).
_HOME_MARKERS = ("mlflow", "nats", "optuna", "data", "creds", "cluster.json", "logs", "runs", "research", "tune")


@dataclass(frozen=True)
class HomeChoice:
    """Which home a command uses and why; `link` asks home() to link the default to a legacy `./.lorafleet`."""

    path: Path
    origin: str  # "LORAFLEET_HOME", "default" or "legacy"
    note: str | None = None  # said once per process on stderr
    link: bool = False


def default_home() -> Path:
    """`$XDG_DATA_HOME/lorafleet`, else `~/.local/share/lorafleet` (a relative XDG_DATA_HOME is ignored, as
    the XDG spec says)."""
    xdg = os.environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return base / "lorafleet"


def _is_lorafleet_home(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in _HOME_MARKERS)


def locate_home() -> HomeChoice:
    """Where the home is, without creating or linking anything (home() does that)."""
    raw = os.environ.get(HOME_ENV)
    if raw:
        return HomeChoice(Path(raw).expanduser().resolve(), HOME_ENV)
    default = default_home()
    try:
        legacy = Path.cwd() / LEGACY_HOME
    except OSError:  # the current directory was deleted
        return HomeChoice(default, "default")
    if not _is_lorafleet_home(legacy) or _same_dir(legacy, default):
        return HomeChoice(default, "default")
    if not os.path.lexists(default):
        # Linked, not moved: the MLflow store, cluster.json and Optuna keep absolute paths into this folder.
        return HomeChoice(legacy.resolve(), "legacy", link=True, note=(
            f"lorafleet: found {legacy} from an earlier version; linked {default} -> {legacy.resolve()}, so every "
            f"command finds it from any directory (set {HOME_ENV} to use another home)"))
    return HomeChoice(default, "default", note=(
        f"lorafleet: {legacy} (from an earlier version) is not used; the home is {default}. To use the old one: "
        f"export {HOME_ENV}={legacy.resolve()}"))


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve(strict=True) == b.resolve(strict=True)
    except OSError:
        return False


_said: set[str] = set()


def home() -> Path:
    """The home (see locate_home): NATS store, MLflow store, Optuna storage, statutes, logs. Created if missing;
    a legacy `./.lorafleet` is linked as the default home when there is none yet (said once on stderr)."""
    choice = locate_home()
    if choice.link:
        default = default_home()
        default.parent.mkdir(parents=True, exist_ok=True)
        try:
            default.symlink_to(choice.path, target_is_directory=True)
        except FileExistsError:  # another command linked or created it meanwhile: decide again
            choice = locate_home()
        except OSError as exc:  # a read-only home: use the old folder from here, and say why it is not linked
            choice = replace(choice, note=f"lorafleet: using {choice.path} from an earlier version; could not link "
                                          f"{default} to it ({exc}); set {HOME_ENV} to use it from any directory")
    if choice.note and choice.note not in _said:
        _said.add(choice.note)
        print(choice.note, file=sys.stderr, flush=True)
    path = choice.path
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def home_line() -> str | None:
    """`home: PATH (why)` when a command uses another home than the default, else None."""
    choice = locate_home()
    if choice.origin == HOME_ENV:
        return f"home: {choice.path} (from {HOME_ENV})"
    if choice.origin == "legacy":
        return f"home: {choice.path} (./{LEGACY_HOME} from an earlier version)"
    return None


# The fleet `lorafleet up` serves when given none, if present (relative: a checkout of this repository).
DEFAULT_FLEET = Path("configs/fleet.yaml")
DATA_SOURCE_FILE = "SOURCE.json"  # written by `lorafleet data fetch`: where the statutes came from


def data_cache_dir() -> Path:
    """Where `lorafleet data fetch` stores the statutes when LORAFLEET_DATA_DIR is not set: LORAFLEET_HOME/data."""
    return home() / "data"


def find_statutes() -> Path | None:
    """The data folder training would read (LORAFLEET_DATA_DIR, else the home's cache) if it holds
    `gesetze/`, else None. Reads only: creates, links and says nothing (tests look with it)."""
    raw = os.environ.get("LORAFLEET_DATA_DIR")
    root = Path(raw).expanduser() if raw else locate_home().path / "data"
    return root.resolve() if (root / "gesetze").is_dir() else None


def data_dir() -> Path:
    """The folder holding `gesetze/*.md`: `LORAFLEET_DATA_DIR` if set, else the cache that
    `lorafleet data fetch` fills (LORAFLEET_HOME/data); a DataDirError that says what to do otherwise."""
    raw = os.environ.get("LORAFLEET_DATA_DIR")
    if raw:
        path = Path(raw).expanduser().resolve()
        if not path.is_dir():
            raise DataDirError(f"LORAFLEET_DATA_DIR={raw} is not a directory (unset it to use the cache that "
                               "`lorafleet data fetch` fills)")
        return path
    cache = data_cache_dir()
    if (cache / "gesetze").is_dir():
        return cache
    raise DataDirError(
        f"no statutes found: run `lorafleet data fetch` (downloads the public bundestag/gesetze collection into "
        f"{cache}), or point LORAFLEET_DATA_DIR at a folder holding gesetze/*.md"
    )


def logs_dir() -> Path:
    path = home() / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def mlflow_tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` if set, else a sqlite store under `LORAFLEET_HOME/mlflow`."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    folder = home() / "mlflow"
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}"


# Tracking URIs answered by an MLflow server, which owns the artifact store: started with
# `--serve-artifacts` its default root is `mlflow-artifacts:/`, proxied over the same URL, so a worker on
# another host can download what a trainer logged. A local file root there would strand artifacts here.
SERVER_SCHEMES = ("http", "https", "databricks")


def mlflow_remote() -> bool:
    """True when MLFLOW_TRACKING_URI names an MLflow server (http(s)://…), not a store on this machine."""
    return urlsplit(mlflow_tracking_uri()).scheme.lower() in SERVER_SCHEMES


def mlflow_artifact_root(sub: str = "") -> str | None:
    """Where new experiments keep artifacts: a folder under LORAFLEET_HOME/mlflow/artifacts (plus `sub`) for a
    store on this machine; None for a tracking server, whose own (proxied) artifact root then applies."""
    if mlflow_remote():
        return None
    folder = home() / "mlflow" / "artifacts"
    folder.mkdir(parents=True, exist_ok=True)
    return f"{folder.as_uri()}/{sub}" if sub else folder.as_uri()
