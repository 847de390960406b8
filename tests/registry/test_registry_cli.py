"""The registry's CLI: `registry list`, bad input on `promote`, and `ui` (a real MLflow server, stopped by Ctrl-C)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from lorafleet.cli import app
from lorafleet.nats.server import free_port
from lorafleet.testing import wait_until

pytestmark = pytest.mark.integration


def _gone(pid: str) -> bool:
    """The process has ended: no /proc entry, or a zombie its parent has not reaped."""
    try:
        return "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return True


def test_registry_list_and_promote_errors(tiny_adapter: Path, tiny_model_dir: Path) -> None:
    from lorafleet.registry import store

    runner = CliRunner()
    empty = runner.invoke(app, ["registry", "list"])
    assert empty.exit_code == 0 and "no registered bundles" in empty.output
    store.register_bundle("legal", tiny_adapter, base_source=str(tiny_model_dir), base_name="tiny",
                          metrics={"test_ndcg@10": 0.4321, "base_test_ndcg@10": 0.3}, alias="candidate")
    out = runner.invoke(app, ["registry", "list"])
    assert out.exit_code == 0, out.output
    line = next(ln for ln in out.output.splitlines() if ln.strip().startswith("v1"))
    assert "candidate" in line and "tiny" in line and "0.4321" in line and "0.3000" in line

    out = runner.invoke(app, ["promote", "nosuch"])
    assert out.exit_code == 1 and "no registered model named 'nosuch'" in out.output
    out = runner.invoke(app, ["promote", "legal", "--version", "4"])
    assert out.exit_code == 1 and "has no version 4" in out.output
    out = runner.invoke(app, ["promote", "legal"])  # no cluster recorded in this LORAFLEET_HOME
    assert out.exit_code == 1 and "no local cluster is recorded" in out.output
    out = runner.invoke(app, ["rollback", "legal"])
    assert out.exit_code == 1 and "no champion to roll back from" in out.output
    assert store.alias_version("legal", "champion") is None


def test_ui_serves_and_ctrl_c_stops_its_group(tmp_path: Path) -> None:
    port = free_port()
    log = open(tmp_path / "ui.log", "wb")  # noqa: SIM115 - the child writes to it until it exits
    proc = subprocess.Popen([sys.executable, "-m", "lorafleet.cli", "ui", "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, env=dict(os.environ), start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        ok = False
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                ok = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            if ok:
                break
            time.sleep(0.5)
        assert ok, (tmp_path / "ui.log").read_text()[-2000:]
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert children, "the UI server should run as a child process"
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends to the foreground command
        assert proc.wait(timeout=30) == 0
        wait_until(lambda: all(_gone(pid) for pid in children), 10, f"the UI's children {children} to end")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
