"""Issue 39: what a base serves under `precision: auto` is what its models were judged at; an explicit precision in
the fleet file is the operator's override, and `promote` says so. A bundle judged at fp32 is served at fp32 by the
generation runtimes (vLLM's own CPU default, bfloat16, was served before without any check)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafleet.core.config import BaseModelSpec, FleetConfig, ServingProfile
from lorafleet.models.precision import JudgedModel, served_precision
from lorafleet.nats.client import ClientSettings
from lorafleet.registry.bundle import build_bundle
from lorafleet.registry.precision_notice import judged_of, precision_notice
from lorafleet.registry.promote import _entry, _target
from lorafleet.registry.store import VersionInfo
from lorafleet.sidecar.vllm_runtime import VllmRuntime
from lorafleet.sidecar.worker import FleetLookup

SUPPORTED = frozenset({"fp32", "bf16"})


def test_auto_serves_what_every_model_was_judged_at() -> None:
    assert served_precision("auto", [], SUPPORTED).precision == "fp32"  # nothing known: the gated precision
    assert served_precision("auto", ["bf16", "bf16"], SUPPORTED).precision == "bf16"
    assert served_precision("auto", ["bf16", None], SUPPORTED).precision == "fp32"  # None: judged at fp32 only
    assert served_precision("auto", ["bf16", "fp16"], SUPPORTED).precision == "fp32"  # one base, one dtype
    assert served_precision("auto", ["fp16"], SUPPORTED).precision == "fp32"  # judged where this device can't run
    explicit = served_precision("bf16", ["fp32"], SUPPORTED)
    assert explicit.precision == "bf16" and explicit.override and "override: judged at fp32" in explicit.reason
    assert not served_precision("bf16", ["bf16"], SUPPORTED).override


def _bundle(tmp_path: Path, precision: str) -> object:
    adapter = tmp_path / f"adapter-{precision}"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"task_type": "CAUSAL_LM", "r": 4}))
    (adapter / "adapter_model.safetensors").write_bytes(b"\0")
    return build_bundle(tmp_path / f"bundle-{precision}", name="heads", adapter_dir=adapter, base_source="/m/llm",
                        base_name="llm", profile=ServingProfile(precision=precision), profile_source="tuned",
                        kind="causal-lm", runtime="vllm")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    return model


def test_a_bundle_judged_at_fp32_is_served_at_fp32_and_an_override_is_reported(tmp_path: Path,
                                                                                model_dir: Path) -> None:
    spec = _bundle(tmp_path, "fp32")
    assert spec.precision == "fp32"  # type: ignore[attr-defined]  # the guard's verdict, recorded in bundle.yaml
    entry = _entry(VersionInfo("heads", "3", "", None), "llm", spec.profile, "promote", spec)  # type: ignore[attr-defined]
    assert judged_of(entry) == "fp32"
    fleet = FleetConfig.model_validate({"bases": [{"name": "llm", "source": str(model_dir), "runtime": "vllm"}]})
    lookup = FleetLookup(fleet)
    lookup.apply_fleet_state({entry.name: entry})
    # The default (`precision: auto`): served at what it was judged at, never vLLM's own bfloat16.
    rt = VllmRuntime(fleet.bases[0], "cpu")
    served = rt.use_judged(lookup.judged_for("llm"))
    assert rt.config.dtype == "float32" and rt.precision == "fp32" and not served.override
    notice = precision_notice("llm", judged_of(entry), {"w1": rt.precision}, "auto")
    assert notice is not None and notice.as_tuned
    # The operator's override in the fleet file: served at bf16, and promote says so first.
    pinned = BaseModelSpec(name="llm", source=str(model_dir), runtime="vllm", precision="bf16")
    rt = VllmRuntime(pinned, "cpu")
    served = rt.use_judged(lookup.judged_for("llm"))
    assert rt.config.dtype == "bfloat16" and served.override
    declared = _target("nats://x", FleetConfig(bases=[pinned]), "fleet.yaml", ClientSettings())
    notice = precision_notice("llm", judged_of(entry), {"w1": rt.precision}, declared.precisions["llm"])
    assert notice is not None and not notice.as_tuned
    assert notice.lines[0].startswith("judged at fp32; the fleet file overrides it with `precision: bf16` on base llm")


def test_a_bundle_judged_at_bf16_is_served_at_bf16(tmp_path: Path, model_dir: Path) -> None:
    spec = _bundle(tmp_path, "bf16")
    entry = _entry(VersionInfo("heads", "4", "", None), "llm", spec.profile, "promote", spec)  # type: ignore[attr-defined]
    rt = VllmRuntime(BaseModelSpec(name="llm", source=str(model_dir), runtime="vllm"), "cpu")
    assert rt.config.dtype == "float32"  # before the fleet state is read: the gated precision
    rt.use_judged([JudgedModel(judged_of(entry))])
    assert rt.config.dtype == "bfloat16" and rt.precision == "bf16"


def test_an_untuned_generative_bundle_is_judged_at_fp32(tmp_path: Path) -> None:
    spec = _bundle(tmp_path, "fp32")
    untuned = spec.model_copy(update={"precision": None, "profile_source": "default"})  # type: ignore[attr-defined]
    entry = _entry(VersionInfo("heads", "5", "", None), "llm", ServingProfile(precision="bf16"), "promote", untuned)
    assert entry.profile is not None and entry.profile.precision is None  # an untuned precision is no verdict
    assert judged_of(entry) == "fp32"  # a generation engine does not probe: its gated numbers are fp32
    st = entry.model_copy(update={"kind": "sentence-transformers"})
    assert judged_of(st) is None  # an embedding base under auto probes it with its adapter instead


# -- a worker process reads the fleet state before serving: its base under `auto` follows the promoted verdict ------

def test_a_worker_serves_an_auto_base_at_the_promoted_models_judged_precision(nats_server: object,
                                                                             start_worker: object,
                                                                             tmp_path: Path) -> None:
    import asyncio

    from lorafleet.core.fleet_state import FleetEntry
    from lorafleet.models.precision import supported_precisions
    from lorafleet.testing import build_tiny_llama

    base = build_tiny_llama(tmp_path / "llama")
    url = nats_server.url  # type: ignore[attr-defined]
    entry = FleetEntry(name="heads", base="llm", adapter_id="heads@v1", adapter_uri=str(tmp_path / "no-adapter"),
                       profile=ServingProfile(precision="bf16"), version="1", registered_model="heads",
                       kind="causal-lm")
    asyncio.run(_put_entry(url, entry))  # promoted before the worker starts
    fleet = {"bases": [{"name": "llm", "source": str(base), "runtime": "transformers"}],
             "worker": {"heartbeat_s": 0.3, "device": "cpu"},
             "queue": {"storage": "memory", "ack_wait_s": 5.0, "max_deliver": 3, "nak_delay_s": 0.1}}
    worker = start_worker(fleet, url, "judged")  # type: ignore[operator]
    hb = asyncio.run(_heartbeat(url, worker.worker_id))
    native = "bf16" in supported_precisions("cpu")
    assert hb.precisions == {"llm": "bf16" if native else "fp32"}  # type: ignore[attr-defined]
    logged = worker.log_file.read_text()
    assert ("every served model was judged at bf16" if native else "judged at bf16, which this device cannot run") \
        in logged, logged[-2000:]


async def _put_entry(url: str, entry: object) -> None:
    import nats

    from lorafleet.core.fleet_state import ensure_fleet_bucket

    nc = await nats.connect(url)
    try:
        kv = await ensure_fleet_bucket(nc.jetstream())
        await kv.put(entry.name, entry.to_bytes())  # type: ignore[attr-defined]
    finally:
        await nc.close()


async def _heartbeat(url: str, worker_id: str) -> object:
    import nats

    from lorafleet.core.wire import Heartbeat, heartbeat_subject

    nc = await nats.connect(url)
    try:
        sub = await nc.subscribe(heartbeat_subject(worker_id))
        while True:
            hb = Heartbeat.from_wire((await sub.next_msg(timeout=10)).data)
            if hb.precisions:
                return hb
    finally:
        await nc.close()
