"""registry/writes.py without servers: SIGTERM reaches a transition as a cancellation (so its undo runs), and a
cancelled caller of `in_thread` learns what the thread wrote before it goes on."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

from lorafleet.registry.writes import in_thread

SIGTERM_SCRIPT = """
import asyncio, os, signal
from lorafleet.registry.writes import run_transition

async def transition():
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        print("undo ran", flush=True)
        raise

run_transition(transition())
"""


def test_sigterm_cancels_the_transition_so_its_undo_runs() -> None:
    done = subprocess.run([sys.executable, "-c", SIGTERM_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 143, (done.returncode, done.stderr)
    assert "undo ran" in done.stdout


def test_a_cancelled_in_thread_waits_for_the_thread() -> None:
    started, release = threading.Event(), threading.Event()
    wrote: list[str] = []

    def slow_write() -> None:
        started.set()
        release.wait(30)
        wrote.append("alias")

    async def main() -> None:
        task = asyncio.ensure_future(in_thread(slow_write))
        await asyncio.to_thread(started.wait, 30)
        task.cancel()
        await asyncio.sleep(0)
        release.set()
        try:
            await task
        except asyncio.CancelledError:
            assert wrote == ["alias"]  # the cancellation arrives only once the write has ended
            return
        raise AssertionError("not cancelled")

    asyncio.run(main())
