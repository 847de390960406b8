"""`lorafleet data fetch`: the German federal statutes from their public source, verified and cached.

The source is the public-domain collection bundestag/gesetze (one `<letter>/<law>/index.md` per law,
converted from gesetze-im-internet.de). It is read from its GitHub archive (the default), another
URL, a local git clone, a local folder in that layout, or a `.tar.gz`/`.zip` file, and stored as the
flat `gesetze/<law>.md` files that training reads, with `SOURCE.json` saying where they came from:
the source, the git commit (from the clone, or from the archive's git header) and the archive's
sha256. Dataset digests include that record, so a digest names the data's commit.

Writing is atomic (a new folder renamed into place), a second fetch of the same commit or archive
changes nothing, and an archive that cannot be read, or holds no law in the expected layout, is
refused with the reason.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tarfile
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from lorafleet.core import settings
from lorafleet.core.settings import DATA_SOURCE_FILE, DataDirError

DEFAULT_SOURCE = "https://github.com/bundestag/gesetze/archive/refs/heads/master.tar.gz"
Say = Callable[[str], None]
PROGRESS_EVERY_S = 2.0  # a download says how far it got this often


class FetchError(DataDirError):
    """The statutes could not be fetched or are not what they should be; nothing was changed."""


@dataclass
class FetchResult:
    dest: Path  # the data folder (holds gesetze/ and SOURCE.json)
    laws: int
    record: dict[str, Any]
    changed: bool


def source_record(root: Path) -> dict[str, Any] | None:
    """The SOURCE.json of a data folder, or None (a folder filled by hand)."""
    path = Path(root) / DATA_SOURCE_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def source_id(root: Path) -> str | None:
    """A short name of where the data came from, for dataset digests: `<source>@<commit or sha256>`."""
    record = source_record(root)
    if not record:
        return None
    return f"{record.get('source')}@{record.get('commit') or record.get('sha256')}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _law_of(member: str) -> str | None:
    """The law's slug if `member` is `…/<letter>/<slug>/index.md` (the public layout), else None."""
    parts = PurePosixPath(member).parts
    if len(parts) < 3 or parts[-1] != "index.md" or len(parts[-3]) != 1:
        return None
    slug = parts[-2]
    if not slug or slug.startswith(".") or "/" in slug or slug in ("..", "."):
        return None
    return slug


# -- reading a source -------------------------------------------------------------------------------

def _from_tar(path: Path) -> tuple[Iterator[tuple[str, bytes]], str | None]:
    try:
        tar = tarfile.open(path)  # noqa: SIM115 - closed by the generator below
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise FetchError(f"{path} is not a readable .tar.gz or .zip archive ({exc}); download it again") from exc
    commit = tar.pax_headers.get("comment") if tar.pax_headers else None  # `git archive` writes the commit here

    def laws() -> Iterator[tuple[str, bytes]]:
        with tar:
            try:
                for member in tar:
                    slug = _law_of(member.name)
                    if slug is None or not member.isfile():  # links and odd entries are never followed
                        continue
                    fh = tar.extractfile(member)
                    if fh is not None:
                        yield slug, fh.read()
            except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
                raise FetchError(f"{path} is damaged ({type(exc).__name__}: {exc}); download it again") from exc

    return laws(), commit


def _from_zip(path: Path) -> tuple[Iterator[tuple[str, bytes]], str | None]:
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise FetchError(f"{path} is not a readable .zip archive ({exc}); download it again") from exc
    commit = archive.comment.decode(errors="replace").strip() or None  # GitHub puts the commit id here

    def laws() -> Iterator[tuple[str, bytes]]:
        with archive:
            for info in archive.infolist():
                slug = _law_of(info.filename)
                if slug is not None and not info.is_dir():
                    try:
                        yield slug, archive.read(info)
                    except (zipfile.BadZipFile, OSError, zlib.error) as exc:
                        raise FetchError(f"{path} is damaged at {info.filename} ({exc}); download it again") from exc

    return laws(), commit


def _from_folder(path: Path) -> tuple[Iterator[tuple[str, bytes]], str | None]:
    commit = None
    if (path / ".git").exists() and shutil.which("git"):
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = out.stdout.strip() or None

    def laws() -> Iterator[tuple[str, bytes]]:
        for index in sorted(path.glob("*/*/index.md")):
            slug = _law_of(index.relative_to(path).as_posix())
            if slug is not None and index.is_file() and not index.is_symlink():
                yield slug, index.read_bytes()

    return laws(), commit


def _download(url: str, dest: Path, say: Say) -> None:
    import httpx

    say(f"[data] downloading {url}")
    t0, got, last = time.monotonic(), 0, time.monotonic()
    try:
        # A short connect timeout: offline, say so in seconds, not after a minute.
        with httpx.stream("GET", url, follow_redirects=True, timeout=httpx.Timeout(60.0, connect=15.0)) as r:
            if r.status_code != 200:
                raise FetchError(f"{url} answered HTTP {r.status_code}; check the URL, or pass a local copy with "
                                 "--source")
            total = int(r.headers.get("content-length") or 0)  # GitHub streams archives without one
            with dest.open("wb") as fh:
                for block in r.iter_bytes(1 << 20):
                    fh.write(block)
                    got += len(block)
                    if time.monotonic() - last >= PROGRESS_EVERY_S:
                        last = time.monotonic()
                        say(f"[data]   {_fetched(got, total, last - t0)}")
    except httpx.HTTPError as exc:
        raise FetchError(f"cannot download {url}: {type(exc).__name__}: {exc}. Offline? Fetch on a machine with "
                         "network access and pass the archive or a clone with --source, or set LORAFLEET_DATA_DIR "
                         "to a folder holding gesetze/*.md") from exc
    say(f"[data] downloaded {got / 2**20:.1f} MB in {time.monotonic() - t0:.0f}s")


def _fetched(got: int, total: int, elapsed: float) -> str:
    """`12.0 MB of 50.3 MB (24 %), 3.1 MB/s`; without a known size, what came so far and the rate."""
    rate = got / max(elapsed, 1e-9) / 2**20
    if total:
        return f"{got / 2**20:.1f} MB of {total / 2**20:.1f} MB ({got / total:.0%}), {rate:.1f} MB/s"
    return f"{got / 2**20:.1f} MB so far, {rate:.1f} MB/s"


# -- fetching -----------------------------------------------------------------------------------------

def fetch_statutes(source: str | None = None, dest: Path | None = None, *, say: Say = print) -> FetchResult:
    """Fetch the statutes from `source` (default: bundestag/gesetze on GitHub) into `dest`.

    `dest` defaults to LORAFLEET_DATA_DIR when set, else the cache under LORAFLEET_HOME/data.
    """
    import os

    source = source or DEFAULT_SOURCE
    if dest is None:
        raw = os.environ.get("LORAFLEET_DATA_DIR")
        dest = Path(raw).expanduser() if raw else settings.data_cache_dir()
    dest = Path(dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest) as tmp:
        work = Path(tmp)
        record: dict[str, Any] = {"source": source, "fetched": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        local = Path(source).expanduser()
        if source.startswith(("http://", "https://")):
            archive = work / "download"
            _download(source, archive, say)
            laws, commit = _open_archive(archive, source)
            record["sha256"] = _sha256(archive)
        elif local.is_dir():
            laws, commit = _from_folder(local.resolve())
            record["source"] = str(local.resolve())
        elif local.is_file():
            laws, commit = _open_archive(local, source)
            record["sha256"] = _sha256(local)
            record["source"] = str(local.resolve())
        else:
            raise FetchError(f"--source {source!r} is neither a URL, a folder nor an archive file")
        record["commit"] = commit
        known = source_record(dest)
        if known and (dest / "gesetze").is_dir() and _same(known, record):
            n = len(list((dest / "gesetze").glob("*.md")))
            say(f"[data] {dest} already holds this source ({_what(record)}, {n} laws); nothing to do")
            return FetchResult(dest, n, known, changed=False)
        staged = work / "gesetze"
        staged.mkdir()
        n = _write_laws(laws, staged, source, say)
        record["laws"] = n
        (work / DATA_SOURCE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        _swap_in(work, dest)
    say(f"[data] {n} laws from {_what(record)} in {dest / 'gesetze'}")
    return FetchResult(dest, n, record, changed=True)


def _open_archive(path: Path, source: str) -> tuple[Iterator[tuple[str, bytes]], str | None]:
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic.startswith(b"PK"):
        return _from_zip(path)
    return _from_tar(path)


def _same(known: dict[str, Any], new: dict[str, Any]) -> bool:
    if new.get("sha256"):
        return known.get("sha256") == new["sha256"]
    return bool(new.get("commit")) and known.get("commit") == new["commit"]


def _what(record: dict[str, Any]) -> str:
    if record.get("commit"):
        return f"commit {str(record['commit'])[:12]}"
    if record.get("sha256"):
        return f"archive sha256 {record['sha256'][:12]}"
    return "an unversioned folder"


def _write_laws(laws: Iterator[tuple[str, bytes]], out: Path, source: str, say: Say) -> int:
    """Write each law as `<slug>.md`; every file must read as UTF-8 Markdown with a title."""
    from lorafleet.train.statutes import parse_law_text

    n = 0
    for slug, raw in laws:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FetchError(f"{source}: {slug}/index.md is not UTF-8 text ({exc}); the source is damaged") from exc
        parse_law_text(slug, text)  # raises on nothing; parsing here proves the file is Markdown we can read
        (out / f"{slug}.md").write_text(text, encoding="utf-8")
        n += 1
        if n % 1000 == 0:
            say(f"[data]   {n} laws")
    if n == 0:
        raise FetchError(f"{source} holds no <letter>/<law>/index.md files: it is not the bundestag/gesetze layout")
    return n


def _swap_in(staged_root: Path, dest: Path) -> None:
    """Replace dest/gesetze and dest/SOURCE.json with the staged ones, one rename each: a reader sees the
    old folder or the new one, never a half-written one."""
    old = staged_root / "old-gesetze"
    target = dest / "gesetze"
    if target.exists():
        target.rename(old)
    (staged_root / "gesetze").rename(target)
    (staged_root / DATA_SOURCE_FILE).replace(dest / DATA_SOURCE_FILE)
    shutil.rmtree(old, ignore_errors=True)
