"""Helpers for the generative serving tests (a unique module name): the tiny Llama with two LoRAs, a
cluster fleet for a generate runtime, direct references (transformers in process, vLLM in its venv),
and fleet-state entries written the way `lorafleet promote` writes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorafleet.bench.common import run_in_vllm_venv
from lorafleet.bench.shadow import build_models
from lorafleet.core.config import FleetConfig
from lorafleet.core.fleet_state import FleetEntry, put_entry
from lorafleet.core.wire import FLEET_KV_BUCKET
from lorafleet.ops.cluster import LocalCluster

BASE = "tiny-llama"
MAX_MODEL_LEN = 512  # the tiny Llama's positions
GREEDY = {"max_tokens": 16, "temperature": 0.0}
QUESTIONS = ["The quick brown fox", "Workers pull tasks from the queue"]


def build_tiny(root: Path, max_positions: int = MAX_MODEL_LEN) -> dict[str, Path]:
    """The tiny random Llama (special tokens muted: greedy output never stops early) and LoRAs "a", "b"."""
    return build_models(root, max_positions)


def fleet(tiny: dict[str, Path], runtime: str, options: dict[str, Any] | None = None, **queue: Any) -> FleetConfig:
    """The base under its own name, "tiny-a" / "tiny-b" with the two LoRAs (from the fleet file)."""
    return FleetConfig.model_validate({
        "bases": [{"name": BASE, "source": str(tiny["base"]), "runtime": runtime, "options": options or {}}],
        "models": [{"name": f"tiny-{n}", "base": BASE, "adapter": str(tiny[n]), "adapter_id": n} for n in ("a", "b")],
        "gateway": {"port": 0, "default_deadline_s": 60},
        "worker": {"heartbeat_s": 0.3, "device": "cpu", "adapter_roots": [str(tiny["base"].parent)]},
        "queue": {"storage": "memory", **queue},
    })


def chat(question: str, system: str | None = None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


def transformers_reference(base: Path, adapter: Path | None, prompts: list[str], max_tokens: int,
                           add_special_tokens: bool) -> list[str]:
    """Greedy text of each prompt alone, with transformers (+ peft), decoded like vLLM does (after the prompt)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    out = []
    for prompt in prompts:
        ids = tok(prompt, add_special_tokens=add_special_tokens, return_tensors="pt").input_ids
        with torch.inference_mode():
            gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        tail = ids[0, -4:].tolist()
        new = gen[0, ids.shape[1]:].tolist()
        if new and new[-1] == tok.eos_token_id:
            new = new[:-1]
        full, head = tok.decode(tail + new, skip_special_tokens=True), tok.decode(tail, skip_special_tokens=True)
        out.append(full[len(head):] if full.startswith(head) else tok.decode(new, skip_special_tokens=True))
    return out


# Direct vLLM generation in the vLLM venv: chat through LLM.chat (vLLM applies the chat template itself)
# and completions through LLM.generate, one prompt per call, greedy, base and each LoRA.
_VLLM_SCRIPT = '''
import json, sys
def main():
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    spec = json.loads(open(sys.argv[1]).read())
    llm = LLM(model=spec["model"], enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
              max_model_len=spec["max_model_len"], enforce_eager=True, seed=0)
    out = {}
    for name, path in [(None, None), *spec["loras"].items()]:
        lora = LoRARequest(name, len(out) + 1, path) if name else None
        for case in spec["cases"]:
            params = SamplingParams(max_tokens=case["max_tokens"], temperature=0.0)
            if case["kind"] == "chat":
                got = llm.chat([case["messages"]], params, lora_request=lora, use_tqdm=False)
            else:
                got = llm.generate([case["prompt"]], params, lora_request=lora, use_tqdm=False)
            out[f"{name or ''}|{case['id']}"] = got[0].outputs[0].text
    print("REFERENCE " + json.dumps(out), flush=True)
if __name__ == "__main__":
    main()
'''


def vllm_reference(venv: Path, tiny: dict[str, Path], cases: list[dict[str, Any]], work: Path,
                   max_model_len: int = MAX_MODEL_LEN) -> dict[str, str]:
    """{"<adapter or ''>|<case id>": text} from direct vLLM (a second engine start, ~30 s)."""
    spec = {"model": str(tiny["base"]), "max_model_len": max_model_len, "cases": cases,
            "loras": {"a": str(tiny["a"]), "b": str(tiny["b"])}}
    return run_vllm_script(venv, work, _VLLM_SCRIPT, spec, timeout=600)


def run_vllm_script(venv: Path, work: Path, script: str, spec: dict[str, Any], *, timeout: float) -> Any:
    """Run `script` (reads spec.json, prints one `REFERENCE <json>` line) in vLLM's venv; that JSON."""
    return run_in_vllm_venv(venv, work, script, spec, timeout=timeout)


async def put_fleet_entry(cluster: LocalCluster, entry: FleetEntry) -> None:
    """What `lorafleet promote` does to the fleet state, with the control credential."""
    import nats

    nc = await nats.connect(cluster.nats_url, allow_reconnect=False, **cluster.client_options("control"))
    try:
        await put_entry(await nc.jetstream().key_value(FLEET_KV_BUCKET), entry)
    finally:
        await nc.close()
