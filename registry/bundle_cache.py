"""The local bundle cache, LORAFLEET_HOME/bundles/NAME/vN: the disk tier under a worker's adapter memory tiers.

`store.fetch_adapter` downloads a bundle here once (verified by digest) and reuses it after. The cache is
bounded in bytes by `LORAFLEET_BUNDLE_CACHE_BYTES` (default 10 GiB): after each download, the least recently
used bundle folders (by modification time; a reuse touches its folder) are deleted until the cache fits,
never the one just fetched, which may exceed the bound alone. A deleted bundle is downloaded again when next
asked for. Deletion renames a folder out of the way first, so a reader sees a whole bundle or none; a
process reading a bundle at the very moment another deletes it fails that load (the worker retries the
task: the next resolve downloads it again).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from lorafleet.core import settings

log = logging.getLogger(__name__)

ENV_CACHE_BYTES = "LORAFLEET_BUNDLE_CACHE_BYTES"
DEFAULT_CACHE_BYTES = 10 * 1024**3


def cache_root() -> Path:
    return settings.home() / "bundles"


def bundle_cache_dir(name: str, version: str) -> Path:
    return cache_root() / name / f"v{version}"


def cache_limit() -> int:
    """The bound from `LORAFLEET_BUNDLE_CACHE_BYTES` (whole bytes), default 10 GiB."""
    raw = os.environ.get(ENV_CACHE_BYTES, "").strip()
    if not raw:
        return DEFAULT_CACHE_BYTES
    try:
        limit = int(raw.replace("_", ""))
    except ValueError:
        limit = -1
    if limit < 0:
        raise ValueError(f"{ENV_CACHE_BYTES}={raw!r} is not a whole number of bytes ≥ 0 (e.g. 10737418240 for "
                         "10 GiB); unset it for the default")
    return limit


def touch(folder: Path) -> None:
    """Mark a cached bundle as just used, so it is the last to go."""
    try:
        os.utime(folder)
    except OSError:
        log.debug("cannot touch %s", folder)


def folder_bytes(folder: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            with contextlib.suppress(OSError):  # deleted meanwhile
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def cached_bundles(root: Path) -> list[Path]:
    """Bundle folders (NAME/vN), least recently used first; partial downloads (dot-folders) excluded."""
    found: list[tuple[float, Path]] = []
    if not root.is_dir():
        return []
    for name in root.iterdir():
        if not name.is_dir() or name.name.startswith("."):
            continue
        for version in name.iterdir():
            if version.is_dir() and version.name.startswith("v"):
                try:
                    found.append((version.stat().st_mtime, version))
                except OSError:
                    continue
    return [p for _, p in sorted(found, key=lambda t: t[0])]


def prune(root: Path, limit: int, keep: Path) -> list[Path]:
    """Delete least recently used bundle folders under `root` until they total at most `limit` bytes, never
    `keep`; returns the deleted folders."""
    bundles = cached_bundles(root)
    sizes = {p: folder_bytes(p) for p in bundles}
    total = sum(sizes.values())
    keep = keep.resolve()
    deleted: list[Path] = []
    for folder in bundles:
        if total <= limit:
            break
        if folder.resolve() == keep:
            continue
        try:
            doomed = Path(tempfile.mkdtemp(prefix=f".{folder.parent.name}-{folder.name}.deleting-", dir=root))
            os.replace(folder, doomed / folder.name)
        except OSError:  # another process deleted or renamed it first
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        rmdir_if_empty(folder.parent)
        total -= sizes[folder]
        deleted.append(folder)
    if deleted:
        log.info("bundle cache %s over %d bytes: deleted %d least recently used bundle(s) (%s)", root, limit,
                 len(deleted), ", ".join(f"{p.parent.name}/{p.name}" for p in deleted))
    return deleted


def rmdir_if_empty(folder: Path) -> None:
    """Remove a bundle name's folder once its last version is gone."""
    with contextlib.suppress(OSError):  # not empty, or gone
        folder.rmdir()
