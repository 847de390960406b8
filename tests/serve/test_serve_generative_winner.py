"""The generative fleet serves the chosen base with a headings specialist on the vllm runtime, and its greedy
answers to ten test sections equal the answers its gate scored and direct generation with the same prompt tokens.

The base, its runtime and engine options come from `configs/fleet-generative.yaml` (whatever base the default
recipe chose); the task (system prompt, input budget, answer budget) from `configs/german-legal-headings.yaml`.
The specialist is a small LoRA (random, so that it visibly changes the base's answers) promoted the way
`lorafleet promote` writes a causal-lm bundle: system prompt, chat template and greedy decoding defaults. The
request carries only the section's text; the gateway adds the system prompt and renders the template. The
reference renders the prompt with the training side's tokenizer (`load_causal_tokenizer`, the tokens training
and evaluation use) and generates from those token ids on a direct vLLM engine with the same adapter, at the
precision the bundle was judged at (float32: no tune verdict, so `precision: auto` serves fp32; issue 39). The
gate's answers are `generate_answers` on the transformers model in float32, the path that scores a specialist's
test ROUGE-L; they are compared after evaluation's cleaning (`clean_answer`), which is what a score reads.

Needs the vLLM venv (`lorafleet runtime install vllm`); skips without it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from generate_kit import put_fleet_entry, run_vllm_script

from lorafleet.core.config import FleetConfig
from lorafleet.core.fleet_state import FleetEntry
from lorafleet.ops.cluster import LocalCluster
from lorafleet.sidecar.vllm_install import find_vllm_venv

VENV = find_vllm_venv()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(1800),  # two engine starts (reference, worker) and a base conversion, on a busy 2-core box
    pytest.mark.skipif(VENV is None, reason="vLLM venv not installed: run `lorafleet runtime install vllm` "
                       "(or `python -m lorafleet.sidecar.vllm_install`)"),
]
REPO = Path(__file__).resolve().parents[2]
FLEET = REPO / "configs" / "fleet-generative.yaml"
TASK = REPO / "configs" / "german-legal-headings.yaml"
LAWS = ["kschg", "agg", "tzbfg", "prodhaftg", "milog", "arbzg", "uwg"]  # small laws: over 10 test sections
N = 10
NAME = "headings"


def served_base() -> dict[str, Any]:
    """The fleet file's base on the vllm runtime (the generative one)."""
    bases = [b for b in yaml.safe_load(FLEET.read_text())["bases"] if b.get("runtime") == "vllm"]
    assert len(bases) == 1, f"{FLEET} should serve one base on the vllm runtime, got {bases}"
    return bases[0]


def options() -> dict[str, Any]:
    # The file's engine settings, lighter where it does not change the arithmetic: eager, fewer sequences.
    return {**served_base().get("options", {}), "max_num_seqs": 8, "slots": 8, "enforce_eager": True}


_REFERENCE = '''
import json, sys
def main():
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    spec = json.loads(open(sys.argv[1]).read())
    llm = LLM(model=spec["model"], enable_lora=True, max_loras=1, max_lora_rank=spec["max_lora_rank"],
              dtype="float32", max_model_len=spec["max_model_len"], enforce_eager=True, seed=0)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0)
    lora = LoRARequest("h", 1, spec["adapter"])
    out = {}
    for tag, request in (("base", None), ("lora", lora)):
        out[tag] = [llm.generate([{"prompt_token_ids": ids}], params, lora_request=request, use_tqdm=False)[0]
                    .outputs[0].text for ids in spec["prompts"]]
    print("REFERENCE " + json.dumps(out), flush=True)
if __name__ == "__main__":
    main()
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Iterator[dict[str, Any]]:
    """Home, the base folder, the task, five test prompts, the adapter; LORAFLEET_HOME stays set for the module."""
    pytest.importorskip("gguf")
    import torch
    from peft import LoraConfig, get_peft_model

    from lorafleet.models.causal import resolve_causal_source
    from lorafleet.train.kinds.generation.causal_lm import load_causal_base
    from lorafleet.train.kinds.generation.config import load_generation_config
    from lorafleet.train.kinds.generation.evaluate import generate_answers
    from lorafleet.train.kinds.generation.headings import HeadingsDataConfig, build_headings

    home = tmp_path_factory.mktemp("winner-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAFLEET_HOME", str(home))  # the converted base is cached there, for the workers too
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        base = served_base()
        task = load_generation_config(TASK)
        assert task.base_model == base["source"], "the fleet serves another base than the recipe trains"
        model, tokenizer = load_causal_base(base["source"], "cpu", "float32", chat_template=task.chat_template)
        cfg = HeadingsDataConfig(**{**task.data.model_dump(), "laws": LAWS, "max_train_examples": 8,
                                    "max_eval_examples": N})
        dataset = build_headings(cfg, tokenizer, data_root=data_dir)
        prompts = dataset.prompts("test")[:N]
        assert len(prompts) == N
        torch.manual_seed(0)
        lora = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, init_lora_weights=False,
                                                target_modules=["q_proj", "v_proj"]))
        adapter = home / "adapters" / "headings-lora"
        lora.save_pretrained(adapter)
        lora.eval()
        with torch.no_grad():  # what the gate scored: evaluation's own generation, float32
            gated = generate_answers(lora, tokenizer, prompts, max_new_tokens=task.max_new_tokens)
        yield {"home": home, "folder": resolve_causal_source(base["source"]), "base": base, "task": task,
               "tokenizer": tokenizer, "prompts": prompts, "adapter": adapter, "gated": gated}


@pytest.fixture(scope="module")
def reference(setup: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Direct vLLM generation from the training side's prompt token ids: base and the adapter."""
    assert VENV is not None
    tok = setup["tokenizer"]
    ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
           for p in setup["prompts"]]
    opts = options()
    spec = {"model": str(setup["folder"]), "adapter": str(setup["adapter"]), "prompts": ids,
            "max_tokens": setup["task"].max_new_tokens, "max_model_len": opts["max_model_len"],
            "max_lora_rank": opts["max_lora_rank"]}
    return run_vllm_script(VENV, tmp_path_factory.mktemp("winner-ref"), _REFERENCE, spec, timeout=900)


@pytest.fixture(scope="module")
def cluster(setup: dict[str, Any], reference: dict[str, list[str]]) -> Iterator[LocalCluster]:
    base = setup["base"]
    cfg = FleetConfig.model_validate({
        "bases": [{"name": base["name"], "source": base["source"], "runtime": "vllm", "options": options()}],
        "models": [], "gateway": {"port": 0, "default_deadline_s": 900},
        "worker": {"heartbeat_s": 0.3, "device": "cpu", "adapter_roots": [str(setup["adapter"].parent)]},
        "queue": {"storage": "memory"},
    })
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAFLEET_HOME", str(setup["home"]))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        with LocalCluster(cfg, workers=1, port=0, home=setup["home"]) as c:
            c.wait_ready(timeout=600, workers=1)
            task = setup["task"]
            entry = FleetEntry(name=NAME, base=base["name"], adapter_id=f"{NAME}@v1",
                               adapter_uri=str(setup["adapter"]), version="1", registered_model=NAME,
                               kind="causal-lm", system_prompt=task.data.system_prompt,
                               chat_template=setup["tokenizer"].chat_template,
                               generation={"max_tokens": task.max_new_tokens, "temperature": 0.0})
            asyncio.run(put_fleet_entry(c, entry))
            yield c


def test_served_specialist_equals_direct_generation(cluster: LocalCluster, setup: dict[str, Any],
                                                    reference: dict[str, list[str]]) -> None:
    import openai

    from lorafleet.train.kinds.generation.evaluate import clean_answer

    # The first request loads the adapter into the engine; on a loaded 2-core box that alone can take minutes.
    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0, timeout=900)
    deadline = time.monotonic() + 60
    while NAME not in {m.id for m in client.models.list().data}:
        assert time.monotonic() < deadline, "the promoted specialist never showed up"
        time.sleep(0.2)
    got = []
    for prompt in setup["prompts"]:
        user = [m for m in prompt if m["role"] == "user"]  # the gateway adds the specialist's system prompt
        # The budget is explicit: a random adapter rarely emits an end token, and a run to the context's end
        # (~2,000 tokens) took longer than the client waits on a loaded box.
        r = client.chat.completions.create(model=NAME, messages=user, temperature=0.0,
                                           max_tokens=setup["task"].max_new_tokens)
        got.append(r.choices[0].message.content)
    assert got == reference["lora"]
    assert [clean_answer(a) for a in got] == [clean_answer(a) for a in setup["gated"]], \
        "the served answers are not the answers the gate scored"
    assert got != reference["base"], "the adapter changed nothing: the test would not see a missing LoRA"
