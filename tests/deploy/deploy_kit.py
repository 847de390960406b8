"""Helpers for the deploy tests: secrets made by deploy/make-secrets.sh, rendering, flags the commands accept."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent


def make_secrets(out: Path, *hosts: str) -> Path:
    """Run deploy/make-secrets.sh into `out` with this interpreter's lorafleet; return `out`."""
    env = {**os.environ, "LORAFLEET": str(BIN / "lorafleet"), "PYTHON": sys.executable,
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(["bash", str(DEPLOY / "make-secrets.sh"), str(out), *hosts], check=True, env=env,
                   capture_output=True, text=True, timeout=120)
    return out


def copy_tree(src: Path, dst: Path) -> Path:
    """A copy of a deploy folder without generated secrets (the test makes its own)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("secrets", "__pycache__"))
    return dst


def nats_config_ok(conf: Path, server_name: str) -> subprocess.CompletedProcess[str]:
    """`nats-server -t`: the real server parses the config and its includes (nothing starts)."""
    env = {**os.environ, "SERVER_NAME": server_name}
    return subprocess.run([str(BIN / "nats-server"), "-c", conf.name, "-t"], cwd=conf.parent, env=env,
                          capture_output=True, text=True, timeout=30)


_FLAG_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def accepted_flags(module: str) -> set[str]:
    """The long options `python -m MODULE --help` lists (what `lorafleet gateway|worker` pass through)."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}, check=True).stdout
    return set(_FLAG_RE.findall(out))


MODULE_OF = {"gateway": "lorafleet.serve", "worker": "lorafleet.sidecar"}


def options(args: list[str]) -> dict[str, str]:
    """`--name=value` arguments → {--name: value}; the manifests write every option so (a bare flag → "")."""
    out: dict[str, str] = {}
    for a in args:
        assert a.startswith("--"), f"write options as --name=value so they read unambiguously, got {a!r}"
        name, _, value = a.partition("=")
        out[name] = value
    return out


def unknown_flags(command: list[str], known: dict[str, set[str]]) -> set[str]:
    """Flags of a `lorafleet gateway|worker …` command line that the command does not accept."""
    verb, *rest = command
    return set(options(rest)) - known[verb]


def check_flags(commands: list[list[str]], known: dict[str, set[str]]) -> None:
    """AssertionError naming every flag of these `lorafleet gateway|worker …` lines their command does not accept."""
    unknown: set[str] = set()
    for cmd in commands:
        unknown |= unknown_flags(cmd, known)
    assert not unknown, f"flags the commands do not accept: {sorted(unknown)}"


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]
