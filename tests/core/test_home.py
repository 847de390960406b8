"""One lorafleet home that every command finds from any directory; an old `./.lorafleet` is found and linked.

The commands run as a user runs them: the `lorafleet` CLI in a subprocess, in different directories, with an
empty HOME of their own (never the real one) and no LORAFLEET_HOME.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from lorafleet.core import settings

LAW = ("---\nTitle: Testgesetz\n---\n\n# Gesetz über Tests (Testgesetz - TestG)\n\n"
       "###### § 1 Zweck\n\nDas Gesetz prüft.\n")


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """A user's environment: their own HOME, nothing that names a lorafleet home or data folder."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LORAFLEET_HOME", "LORAFLEET_DATA_DIR", "LORAFLEET_DATA_SOURCE", "XDG_DATA_HOME")}
    return {**env, "HOME": str(home), **extra}


def lorafleet(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "lorafleet.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def law_archive(path: Path) -> Path:
    """A `.tar.gz` in the public bundestag/gesetze layout (`<letter>/<law>/index.md`) holding one law."""
    src = path.parent / "src" / "t" / "testg"
    src.mkdir(parents=True)
    (src / "index.md").write_text(LAW)
    with tarfile.open(path, "w:gz") as tar:
        tar.add(src.parent.parent, arcname="gesetze-master")
    return path


def test_default_home_is_the_xdg_data_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAFLEET_HOME")
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.chdir(tmp_path)
    assert settings.home() == tmp_path / "user" / ".local" / "share" / "lorafleet"
    assert settings.home_line() is None  # the default goes unsaid
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert settings.home() == tmp_path / "xdg" / "lorafleet"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/data")  # the XDG spec: a relative path is ignored
    assert settings.default_home() == tmp_path / "user" / ".local" / "share" / "lorafleet"
    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path / "mine"))
    assert settings.home() == tmp_path / "mine"
    assert settings.home_line() == f"home: {tmp_path / 'mine'} (from LORAFLEET_HOME)"


def test_two_commands_in_two_directories_see_one_home(tmp_path: Path) -> None:
    env = user_env(tmp_path / "user")
    archive = law_archive(tmp_path / "dl" / "gesetze-master.tar.gz")
    default = tmp_path / "user" / ".local" / "share" / "lorafleet"

    fetched = lorafleet(tmp_path / "clone", env, "data", "fetch", "--source", str(archive))
    assert fetched.returncode == 0, fetched.stderr
    info = lorafleet(tmp_path / "elsewhere", env, "data", "info")
    assert info.returncode == 0, info.stderr
    assert f"data folder: {default / 'data'}" in info.stdout and "laws: 1 (testg)" in info.stdout
    assert "home:" not in info.stderr  # the default home goes unsaid
    status = lorafleet(tmp_path / "third", env, "status")
    assert status.returncode == 1 and f"no local cluster is recorded under {default}" in status.stderr
    assert not (tmp_path / "clone" / ".lorafleet").exists() and not (tmp_path / "elsewhere" / ".lorafleet").exists()

    # Another home is named on every command that reads it.
    moved = lorafleet(tmp_path / "elsewhere", {**env, "LORAFLEET_HOME": str(tmp_path / "other")}, "data", "info")
    assert f"home: {tmp_path / 'other'} (from LORAFLEET_HOME)" in moved.stderr


def test_an_old_dot_lorafleet_is_found_linked_and_said(tmp_path: Path) -> None:
    env = user_env(tmp_path / "user")
    default = tmp_path / "user" / ".local" / "share" / "lorafleet"
    old = tmp_path / "clone" / ".lorafleet"  # what `lorafleet data fetch` in the clone left before
    (old / "data" / "gesetze").mkdir(parents=True)
    (old / "data" / "gesetze" / "testg.md").write_text(LAW)

    first = lorafleet(tmp_path / "clone", env, "data", "info")
    assert first.returncode == 0, first.stderr
    assert f"found {old} from an earlier version; linked {default} -> {old}" in first.stderr
    assert f"data folder: {old / 'data'}" in first.stdout
    assert default.is_symlink() and default.resolve() == old  # linked, not moved: absolute paths inside stay valid

    later = lorafleet(tmp_path / "elsewhere", env, "data", "info")  # any directory now finds it, silently
    assert f"data folder: {old / 'data'}" in later.stdout and later.stderr == ""

    another = tmp_path / "other-clone" / ".lorafleet"  # a second old home cannot be the default too: said so
    (another / "mlflow").mkdir(parents=True)
    third = lorafleet(tmp_path / "other-clone", env, "data", "info")
    assert f"{another} (from an earlier version) is not used; the home is {default}" in third.stderr
    assert f"export LORAFLEET_HOME={another}" in third.stderr and f"data folder: {old / 'data'}" in third.stdout

    # A folder named .lorafleet that is not a lorafleet home (a remote worker's credential, as docs/security.md
    # suggests) is left alone.
    (tmp_path / "worker" / ".lorafleet").mkdir(parents=True)
    (tmp_path / "worker" / ".lorafleet" / "worker.nk").write_text("seed")
    plain = lorafleet(tmp_path / "worker", env, "data", "info")
    assert "earlier version" not in plain.stderr and f"data folder: {old / 'data'}" in plain.stdout
