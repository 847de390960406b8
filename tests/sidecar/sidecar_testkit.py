"""Helpers for the worker tests: tiny LoRA adapters, a fleet dict, a worker subprocess (unique module name)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

BASE = "tiny"


def make_adapter(base_dir: Path, out_dir: Path, seed: int) -> Path:
    """A LoRA adapter on the tiny base whose weights are random (init_lora_weights=False), so it changes outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(seed)
    model = SentenceTransformer(str(base_dir), device="cpu")
    peft_model = get_peft_model(
        model.transformers_model,
        LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], init_lora_weights=False),
    )
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def fleet_dict(tiny_model_dir: Path, adapters: dict[str, Path], **worker: Any) -> dict[str, Any]:
    return {
        "bases": [{"name": BASE, "source": str(tiny_model_dir)}],
        # Served model "tiny-a": its adapter URI comes from this config; tasks for "b" carry theirs, which the
        # worker accepts because it lies under one of its adapter roots.
        "models": [{"name": "tiny-a", "base": BASE, "adapter": str(adapters["a"]), "adapter_id": "a"}],
        "worker": {"heartbeat_s": 0.3, "device": "cpu",
                   "adapter_roots": sorted({str(p.parent) for p in adapters.values()}), **worker},
        "queue": {"storage": "memory", "ack_wait_s": 5.0, "max_deliver": 3, "nak_delay_s": 0.1},
    }


async def until(cond: Callable[[], bool | Awaitable[bool]], timeout: float, what: str, poll_s: float = 0.02) -> None:
    """Wait for a known state (`cond` true, sync or async); AssertionError naming `what` after `timeout`."""
    from lorafleet.testing import wait_until_async

    await wait_until_async(cond, timeout, what, poll_s=poll_s)


def create_streams(fleet_file: Path, nats_url: str) -> None:
    """What a gateway or `lorafleet up` does before workers can serve: workers never create the streams."""
    from lorafleet.core.config import FleetConfig, load_yaml_model
    from lorafleet.nats.queue import ensure_fleet_streams

    async def create() -> None:
        import nats

        nc = await nats.connect(nats_url)
        try:
            await ensure_fleet_streams(nc.jetstream(), load_yaml_model(FleetConfig, fleet_file))
        finally:
            await nc.close()

    asyncio.run(create())


class WorkerProcess:
    """`python -m lorafleet.sidecar` as a child process; ready once its first heartbeat arrives."""

    def __init__(self, fleet_file: Path, nats_url: str, worker_id: str, log_file: Path, streams: bool = True,
                 args: tuple[str, ...] = ()) -> None:
        if streams:
            create_streams(fleet_file, nats_url)
        self.worker_id = worker_id
        self.nats_url = nats_url
        self.log_file = log_file
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self._log = open(log_file, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lorafleet.sidecar", "--fleet", str(fleet_file), "--nats-url", nats_url,
             "--worker-id", worker_id, *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def wait_ready(self, timeout: float = 90.0) -> None:
        asyncio.run(self._wait_heartbeat(timeout))

    async def _wait_heartbeat(self, timeout: float) -> None:
        import nats

        from lorafleet.core.wire import heartbeat_subject

        nc = await nats.connect(self.nats_url)
        sub = await nc.subscribe(heartbeat_subject(self.worker_id))
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    await sub.next_msg(timeout=0.5)
                    return
                except TimeoutError:
                    continue
            raise AssertionError(f"worker sent no heartbeat within {timeout}s:\n{self.log()}")
        finally:
            await nc.close()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int:
        self.terminate()
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait(timeout=10)
        self._log.close()
        return rc
