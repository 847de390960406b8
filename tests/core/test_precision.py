"""Precision as a serving dimension (lorafleet/models/precision.py): native formats from CPU flags, what a device
supports,
explicit precisions checked at fleet load (`lorafleet up`), and the cached `auto` verdict (pure logic)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from lorafleet.core.config import BaseModelSpec, ConfigError, FleetConfig, ServedModel
from lorafleet.core.wire import Heartbeat, WireError
from lorafleet.models import precision
from lorafleet.ops.cluster import load_fleet

# Literal /proc/cpuinfo excerpts: a Sapphire Rapids core (AVX512_BF16 and AMX), a Zen 3 core (AVX2, no AVX-512),
# an Ice Lake core (AVX-512 without BF16), a Neoverse V1 (ARM, bf16) and a Cortex-A72 (ARM, none).
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht \
syscall nx pdpe1gb rdtscp lm constant_tsc avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16 \
amx_bf16 avx512_fp16 amx_tile amx_int8
bugs\t\t: spectre_v1 spectre_v2
"""
ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7763 64-Core Processor
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht \
syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl fma cx16 sse4_1 sse4_2 movbe popcnt aes \
xsave avx f16c rdrand avx2 bmi2 sha_ni
"""
ICE_LAKE = """processor\t: 0
flags\t\t: fpu sse sse2 avx avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bitalg
"""
NEOVERSE_V1 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop \
sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
"""
CORTEX_A72 = """processor\t: 0
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid
CPU implementer\t: 0x41
"""


@pytest.mark.parametrize(("text", "native"), [
    (SAPPHIRE_RAPIDS, {"bf16"}), (ZEN3, set()), (ICE_LAKE, set()), (NEOVERSE_V1, {"bf16"}), (CORTEX_A72, set()),
    ("", set()),
])
def test_native_precisions_from_cpu_flags(text: str, native: set[str]) -> None:
    assert precision.native_cpu_precisions(text) == native


def test_supported_precisions_on_cpus_with_and_without_bf16() -> None:
    int8 = {"int8"} if precision.int8_available() else set()
    assert precision.supported_precisions("cpu", cpuinfo=SAPPHIRE_RAPIDS) == {"fp32", "bf16", *int8}
    assert precision.supported_precisions("cpu", cpuinfo=ZEN3) == {"fp32", *int8}
    assert "fp16" not in precision.supported_precisions("cpu", cpuinfo=SAPPHIRE_RAPIDS)  # no fp16 on CPUs


def test_supported_precisions_on_this_machine() -> None:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.lower().startswith(("flags", "features")):
            flags |= set(line.split(":", 1)[1].split())
    here = precision.supported_precisions("cpu")
    assert "fp32" in here
    assert ("bf16" in here) == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    assert ("int8" in here) == precision.int8_available()


def test_auto_tries_the_fastest_first() -> None:
    assert precision.candidates({"fp32", "bf16", "int8"}) == ["bf16", "int8"]
    assert precision.candidates({"fp32", "fp16", "bf16"}) == ["fp16", "bf16"]
    assert precision.candidates({"fp32"}) == []


def test_explicit_unsupported_precision_names_what_is_supported() -> None:
    with pytest.raises(ConfigError, match=r"bases\.m\.precision is 'fp16'.*supports bf16, fp32, int8"):
        precision.check_precision("m", "sentence-transformers", "fp16", {"fp32", "bf16", "int8"}, "cpu")
    precision.check_precision("m", "sentence-transformers", "auto", {"fp32"}, "cpu")  # auto: always allowed


def _fleet(tmp_path: Path, **base: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"bases": [{"name": "m", **base}], "worker": {"device": "cpu"}}))
    return path


def test_unsupported_precision_stops_fleet_load(tmp_path: Path) -> None:
    # fp16 has no CPU kernels worth serving on: the fleet does not load, whatever this CPU is.
    with pytest.raises(ConfigError, match=r"bases\.m\.precision is 'fp16', but runtime 'sentence-transformers' on "
                                          r"cpu supports .*fp32"):
        load_fleet(_fleet(tmp_path, precision="fp16"))
    assert load_fleet(_fleet(tmp_path, precision="fp32")).bases[0].precision == "fp32"
    assert load_fleet(_fleet(tmp_path)).bases[0].precision == "auto"
    with pytest.raises(ConfigError, match="precision"):  # a typo is a validation error, as every key's
        load_fleet(_fleet(tmp_path, precision="bfloat16"))


def test_up_refuses_an_unsupported_precision_before_starting_anything(tmp_path: Path) -> None:
    from lorafleet.cli import app

    result = CliRunner().invoke(app, ["up", "--fleet", str(_fleet(tmp_path, precision="fp16")),
                                      "--home", str(tmp_path / "home")])
    assert result.exit_code == 1
    assert "supports" in result.output and "fp16" in result.output
    assert not (tmp_path / "home" / "cluster.json").exists()


def test_int8_base_with_adapters_is_refused(tmp_path: Path) -> None:
    if "int8" not in precision.supported_precisions("cpu"):
        pytest.skip("torch has no quantised engine here")
    fleet = FleetConfig(bases=[BaseModelSpec(name="m", precision="int8")],
                        models=[ServedModel(name="legal", base="m", adapter=str(tmp_path))])
    with pytest.raises(ConfigError, match=r"int8.*legal.*LoRA"):
        precision.check_fleet_precisions(fleet, device="cpu")
    precision.check_fleet_precisions(FleetConfig(bases=[BaseModelSpec(name="m", precision="int8")]), device="cpu")


def test_pinned_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(precision.AUTO_ENV, "fp32")
    assert precision.pinned_auto({"fp32", "bf16"}) == "fp32"
    monkeypatch.setenv(precision.AUTO_ENV, "fp16")
    with pytest.raises(ConfigError, match="fp16"):
        precision.pinned_auto({"fp32", "bf16"})
    monkeypatch.delenv(precision.AUTO_ENV)
    assert precision.pinned_auto({"fp32"}) is None


def _vectors(noise: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(len(precision.PROBE_SENTENCES), 16)) * noise


def test_auto_serves_the_first_candidate_that_keeps_quality_and_caches_it(tmp_path: Path) -> None:
    ref = _vectors(1.0)
    # int8 drifts far from fp32, bf16 a little: the fastest passing one (bf16 here) is served.
    outputs = {"fp32": ref, "bf16": ref + _vectors(0.001, 1), "int8": ref + _vectors(0.5, 2)}
    calls: list[str] = []

    def embed_at(p: str) -> np.ndarray:
        calls.append(p)
        return outputs[p]

    cache = tmp_path / "precision.json"
    verdict = precision.choose_auto("k", ["int8", "bf16"], embed_at, cache)
    assert verdict.precision == "bf16" and not verdict.cached
    assert verdict.cosines["int8"] < precision.GUARD_MIN_COSINE <= verdict.cosines["bf16"]
    assert calls == ["fp32", "int8", "bf16"]
    assert "int8 min cosine" in verdict.reason() and "<" in verdict.reason()
    # A later start reads the verdict and probes nothing.
    again = precision.choose_auto("k", ["int8", "bf16"], embed_at, cache)
    assert again.precision == "bf16" and again.cached and calls == ["fp32", "int8", "bf16"]
    # Another key (another model or device) probes on its own; none passing serves fp32.
    assert precision.choose_auto("other", ["int8"], embed_at, cache).precision == "fp32"
    assert set(json.loads(cache.read_text())) == {"k", "other"}


def test_a_cached_verdict_for_a_candidate_no_longer_tried_is_ignored(tmp_path: Path) -> None:
    cache = tmp_path / "precision.json"
    cache.write_text('{"k": {"precision": "int8", "cosines": {}}}')
    verdict = precision.choose_auto("k", ["bf16"], lambda p: _vectors(1.0), cache)
    assert verdict.precision == "bf16" and not verdict.cached


def test_heartbeats_carry_precisions() -> None:
    hb = Heartbeat(worker="w", bases=["m"], adapters={"m": []}, in_flight=0, batches_per_s=0.0, tasks_done=0, pid=1,
                   host="h", precisions={"m": "bf16"})
    assert Heartbeat.from_wire(hb.to_wire()).precisions == {"m": "bf16"}
    plain = Heartbeat(worker="w", bases=["m"], adapters={}, in_flight=0, batches_per_s=0.0, tasks_done=0, pid=1,
                      host="h")
    assert Heartbeat.from_wire(plain.to_wire()).precisions == {}  # an older worker's heartbeat
    from lorafleet.core.wire import pack, unpack

    bad = unpack(hb.to_wire())
    bad["pr"] = {"m": 16}
    with pytest.raises(WireError, match="'pr'"):
        Heartbeat.from_wire(pack(bad))


def test_workers_starting_together_keep_every_verdict(tmp_path: Path) -> None:
    import threading

    cache = tmp_path / "precision.json"
    keys = [f"model-{i}" for i in range(12)]
    start = threading.Barrier(len(keys))

    def one(key: str) -> None:
        start.wait()  # all read-modify-write the file at once
        precision.choose_auto(key, ["bf16"], lambda p: _vectors(1.0), cache)

    threads = [threading.Thread(target=one, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(json.loads(cache.read_text())) == set(keys)
