"""`lorafleet data fetch` from a source in the public bundestag/gesetze layout, made by the test."""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lorafleet.cli import app
from lorafleet.core.settings import DataDirError
from lorafleet.core.settings import data_dir as find_data_dir
from lorafleet.train.statute_source import FetchError, fetch_statutes, source_id

LAWS = ("kschg", "agg")


def public_clone(tmp_path: Path, shared: Path) -> Path:
    """A git repository with two laws as `<letter>/<law>/index.md`, like github.com/bundestag/gesetze."""
    repo = tmp_path / "gesetze"
    for law in LAWS:
        folder = repo / law[0] / law
        folder.mkdir(parents=True)
        shutil.copy(shared / "gesetze" / f"{law}.md", folder / "index.md")
    (repo / "README.md").write_text("Gesetze des Bundes\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "two laws"], check=True)
    return repo


def commit_of(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_fetch_from_a_clone_fills_the_cache_that_training_reads(tmp_path: Path, data_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    repo = public_clone(tmp_path, data_dir)
    monkeypatch.delenv("LORAFLEET_DATA_DIR")
    with pytest.raises(DataDirError, match="run `lorafleet data fetch`"):  # offline, nothing fetched: that error
        find_data_dir()
    out = CliRunner().invoke(app, ["data", "fetch", "--source", str(repo)])
    assert out.exit_code == 0, out.output
    root = find_data_dir()
    assert sorted(p.name for p in (root / "gesetze").glob("*.md")) == ["agg.md", "kschg.md"]
    record = json.loads((root / "SOURCE.json").read_text())
    assert record["commit"] == commit_of(repo) and record["laws"] == 2
    assert source_id(root) == f"{repo}@{record['commit']}"

    # Training reads it, and the digest names the commit.
    from lorafleet.train import TrainConfig, build_dataset
    from lorafleet.train.kinds.retrieval.dataset import compute_digest

    cfg = TrainConfig(base_model="all-MiniLM-L6-v2", data={"laws": ["kschg"], "hard_negatives": False})
    ds = build_dataset(cfg)
    assert ds.settings["source"].endswith(record["commit"])
    ds.settings["source"] = "other@commit"
    assert compute_digest(ds) != ds.digest

    again = fetch_statutes(str(repo), say=lambda _: None)  # the same commit: a no-op
    assert not again.changed and again.laws == 2
    assert json.loads((root / "SOURCE.json").read_text())["fetched"] == record["fetched"]


def test_fetch_from_archives_and_refusals(tmp_path: Path, data_dir: Path) -> None:
    repo = public_clone(tmp_path, data_dir)
    archive = tmp_path / "gesetze-master.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(repo, arcname="gesetze-master", filter=lambda m: None if "/.git" in m.name else m)
    dest = tmp_path / "data"
    result = fetch_statutes(str(archive), dest, say=lambda _: None)
    assert result.changed and result.laws == 2 and result.record["sha256"]
    assert (dest / "gesetze" / "agg.md").read_text() == (data_dir / "gesetze" / "agg.md").read_text()
    assert not fetch_statutes(str(archive), dest, say=lambda _: None).changed

    corrupt = tmp_path / "corrupt.tar.gz"
    corrupt.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(FetchError, match=r"damaged|not a readable"):
        fetch_statutes(str(corrupt), tmp_path / "other", say=lambda _: None)
    assert not (tmp_path / "other" / "gesetze").exists()  # nothing half-written

    empty = tmp_path / "empty.tar.gz"
    with tarfile.open(empty, "w:gz") as tar:
        tar.add(repo / "README.md", arcname="x/README.md")
    with pytest.raises(FetchError, match="not the bundestag/gesetze layout"):
        fetch_statutes(str(empty), tmp_path / "other", say=lambda _: None)
    with pytest.raises(FetchError, match="neither a URL, a folder nor an archive"):
        fetch_statutes(str(tmp_path / "nope"), tmp_path / "other", say=lambda _: None)
    # The earlier good fetch is untouched by the refusals.
    assert sorted(p.name for p in (dest / "gesetze").iterdir()) == ["agg.md", "kschg.md"]


def public_archive(shared: Path, path: Path, laws: list[str] | None = None) -> Path:
    """A `.tar.gz` like GitHub's archive of bundestag/gesetze (`gesetze-master/<letter>/<law>/index.md`)."""
    with tarfile.open(path, "w:gz") as tar:
        for law in laws or sorted(p.stem for p in (shared / "gesetze").glob("*.md")):
            tar.add(shared / "gesetze" / f"{law}.md", arcname=f"gesetze-master/{law[0]}/{law}/index.md")
    return path


def test_if_missing_fetches_once_from_the_source_the_environment_names(tmp_path: Path, data_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """What scripts/setup.sh runs: `data fetch --if-missing`, here with LORAFLEET_DATA_SOURCE as the network."""
    monkeypatch.delenv("LORAFLEET_DATA_DIR")
    monkeypatch.setenv("LORAFLEET_DATA_SOURCE", str(public_archive(data_dir, tmp_path / "g.tar.gz", list(LAWS))))
    first = CliRunner().invoke(app, ["data", "fetch", "--if-missing"])
    assert first.exit_code == 0 and "2 laws in" in first.output and "(updated)" in first.output, first.output
    again = CliRunner().invoke(app, ["data", "fetch", "--if-missing"])
    assert again.exit_code == 0 and "nothing fetched" in again.output, again.output
    assert sorted(p.name for p in (find_data_dir() / "gesetze").glob("*.md")) == ["agg.md", "kschg.md"]


def test_a_download_says_how_many_bytes_it_fetched(tmp_path: Path, data_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Over real HTTP (a local server): a line per block with the bytes so far, of the announced size."""
    import threading
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    from lorafleet.train import statute_source

    served = tmp_path / "served"
    served.mkdir()
    archive = public_archive(data_dir, served / "gesetze-master.tar.gz")
    monkeypatch.setattr(statute_source, "PROGRESS_EVERY_S", 0.0)  # every block, not every 2 s
    handler = partial(SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    lines: list[str] = []
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/gesetze-master.tar.gz"
        result = fetch_statutes(url, tmp_path / "data", say=lines.append)
    finally:
        server.shutdown()
        server.server_close()
    size = archive.stat().st_size / 2**20
    progress = [ln for ln in lines if f"MB of {size:.1f} MB" in ln]
    assert progress and progress[-1].startswith(f"[data]   {size:.1f} MB of {size:.1f} MB (100%)"), lines
    assert result.laws == len(list((data_dir / "gesetze").glob("*.md")))
    assert not any(ch in "".join(lines) for ch in "\r\x1b")  # plain lines
