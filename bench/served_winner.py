"""Does a promoted generative specialist answer through the fleet as it answered when it was scored?

For a registered causal-lm bundle (a research winner that `lorafleet promote` put live), the first `--n` test
sections of its own dataset (rebuilt from the `train_config` the bundle records, so the same sections, cut the
same way) go through `/v1/chat/completions` of a running gateway: the user turn only (the gateway adds the
bundle's system prompt and renders its chat template), greedy, the bundle's answer budget. Each answer is
compared with direct generation:

- `transformers`: the base and the adapter loaded as evaluation loads them (`train.dtype`, float32 on a CPU) and
  `generate_answers`, the very path that scored the bundle's test ROUGE-L;
- `vllm` (needs the vLLM venv): a direct vLLM engine with the adapter, at the precision the bundle was judged at
  (what a base under `precision: auto` serves it at: float32 unless tune's guard qualified bf16; issue 39), fed
  the prompt token ids that the training side's tokenizer renders.

Answers are compared after evaluation's cleaning (the first non-empty line, stripped), which is what a score or a
user reads. A difference from `vllm` is a serving defect; one from `transformers` alone is the engine's precision
(bfloat16 against float32 arithmetic) and is reported as such.

    lorafleet up --fleet configs/fleet-generative.yaml --detach
    lorafleet promote german-legal-headings
    python -m lorafleet.bench.served_winner german-legal-headings [--version champion] [--n 10] \\
        [--url http://127.0.0.1:8080] [--reference transformers,vllm]

Results: bench/results/served-winner.json (`--out` to change).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from lorafleet.bench.common import RESULTS_DIR, machine_info, run_in_vllm_venv, say, stamp, write_json

REFERENCES = ("transformers", "vllm")

_VLLM_REFERENCE = '''
import json, sys
def main():
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    spec = json.loads(open(sys.argv[1]).read())
    llm = LLM(model=spec["model"], enable_lora=True, max_loras=1, max_lora_rank=spec["max_lora_rank"],
              dtype=spec["dtype"], max_model_len=spec["max_model_len"], enforce_eager=True, seed=0)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0)
    lora = LoRARequest("winner", 1, spec["adapter"])
    out = [llm.generate([{"prompt_token_ids": ids}], params, lora_request=lora, use_tqdm=False)[0].outputs[0].text
           for ids in spec["prompts"]]
    print("REFERENCE " + json.dumps(out), flush=True)
if __name__ == "__main__":
    main()
'''


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lorafleet.bench.served_winner", description=__doc__.split("\n\n")[0])
    p.add_argument("name", help="registered model name of a causal-lm bundle (served under that name)")
    p.add_argument("--version", default="champion", help="version number or alias (default: champion)")
    p.add_argument("--n", type=int, default=10, help="test sections to send (default 10)")
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the gateway")
    p.add_argument("--api-key", default=os.environ.get("LORAFLEET_API_KEY"),
                   help="the gateway's API key, if it has any (default: $LORAFLEET_API_KEY)")
    p.add_argument("--reference", default="transformers,vllm",
                   help=f"direct generation to compare with, comma-separated among {', '.join(REFERENCES)}")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request (the first one loads the adapter)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "served-winner.json")
    args = p.parse_args(argv)
    refs = [r.strip() for r in args.reference.split(",") if r.strip()]
    unknown = sorted(set(refs) - set(REFERENCES))
    if unknown:
        p.error(f"--reference: unknown {unknown}; choose among {', '.join(REFERENCES)}")
    if args.n < 1:
        p.error("--n must be at least 1")
    args.references = refs
    return args


def winner_task(name: str, version: str) -> tuple[Any, Path, Any, str | None]:
    """(version info, adapter folder, the winner's GenerationTrainConfig, the precision it was judged at)."""
    from lorafleet.pipeline import TRAIN_CONFIG
    from lorafleet.registry import store
    from lorafleet.train.kinds.generation.config import GenerationTrainConfig

    adapter, spec, info = store.fetch_adapter(name, version)
    if spec.kind != "causal-lm":
        raise SystemExit(f"{name} v{info.version} is a {spec.kind} bundle; this check is for causal-lm specialists")
    raw = spec.details.get(TRAIN_CONFIG)
    if not raw:
        raise SystemExit(f"{name} v{info.version} records no {TRAIN_CONFIG!r}: its test sections cannot be rebuilt")
    return info, adapter, GenerationTrainConfig.model_validate(raw), spec.precision


def served_answers(url: str, name: str, prompts: list[list[dict[str, str]]], max_tokens: int,
                   api_key: str | None, timeout_s: float) -> list[str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = []
    with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as client:
        for i, prompt in enumerate(prompts, 1):
            user = [m for m in prompt if m["role"] == "user"]  # the gateway adds the bundle's system prompt
            r = client.post("/v1/chat/completions", json={"model": name, "messages": user, "temperature": 0.0,
                                                          "max_tokens": max_tokens})
            if r.status_code != 200:
                raise SystemExit(f"{url}/v1/chat/completions answered {r.status_code}: {r.text[:500]}")
            out.append(r.json()["choices"][0]["message"]["content"])
            say(f"served {i}/{len(prompts)}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from lorafleet.models.causal import resolve_causal_source
    from lorafleet.models.device import resolve_device
    from lorafleet.train.kinds.generation.causal_lm import load_causal_adapter, load_causal_tokenizer
    from lorafleet.train.kinds.generation.evaluate import clean_answer, generate_answers
    from lorafleet.train.kinds.generation.headings import build_headings

    info, adapter, cfg, judged = winner_task(args.name, args.version)
    tokenizer = load_causal_tokenizer(cfg.base_model, cfg.chat_template)
    dataset = build_headings(cfg.data, tokenizer)
    prompts = dataset.prompts("test")[: args.n]
    refs = dataset.references("test")[: args.n]
    ids = [dataset.examples["test"][i].id for i in range(len(prompts))]
    say(f"{args.name} v{info.version} (base {cfg.base_model}): {len(prompts)} test sections")
    t0 = time.perf_counter()
    served = served_answers(args.url, args.name, prompts, cfg.max_new_tokens, args.api_key, args.timeout_s)
    result: dict[str, Any] = {"when": stamp(), "machine": machine_info(), "model": args.name,
                              "version": info.version, "base": cfg.base_model, "sections": ids, "headings": refs,
                              "served": served, "served_s": round(time.perf_counter() - t0, 2), "references": {}}
    for ref in args.references:
        if ref == "transformers":
            model, tok = load_causal_adapter(cfg.base_model, adapter, resolve_device(cfg.device), cfg.dtype,
                                             chat_template=cfg.chat_template)
            direct = generate_answers(model, tok, prompts, batch_size=cfg.eval_batch_size,
                                      max_new_tokens=cfg.max_new_tokens, description="direct, transformers")
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            del model
        else:
            from lorafleet.sidecar.vllm_install import find_vllm_venv

            venv = find_vllm_venv()
            if venv is None:
                say("vllm: no vLLM venv (lorafleet runtime install vllm); skipped")
                continue
            token_ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"] for p in prompts]
            dtype = "bfloat16" if judged == "bf16" else "float32"  # what `auto` serves it at (vllm_runtime.py)
            with tempfile.TemporaryDirectory(prefix="served-winner-") as work:
                raw = run_in_vllm_venv(venv, Path(work), _VLLM_REFERENCE, {
                    "model": str(resolve_causal_source(cfg.base_model)), "adapter": str(adapter),
                    "prompts": token_ids, "max_tokens": cfg.max_new_tokens, "max_model_len": 2048,
                    "max_lora_rank": max(16, cfg.lora.r), "dtype": dtype}, timeout=900)
            direct = [clean_answer(t) for t in raw]
        same = [clean_answer(s) == d for s, d in zip(served, direct, strict=True)]
        result["references"][ref] = {"dtype": dtype, "answers": direct, "equal": same, "n_equal": sum(same)}
        say(f"{ref} ({dtype}): {sum(same)}/{len(same)} served answers equal direct generation")
    rows = [f"{i:<16} {h[:34]:<34} | {s[:34]:<34} | " + " ".join(
        "=" if v["equal"][k] else "≠" for v in result["references"].values())
        for k, (i, h, s) in enumerate(zip(ids, refs, served, strict=True))]
    print("\n".join(["section          heading                            | served", *rows]))
    write_json(args.out, result)
    say(f"wrote {args.out}")
    return 0 if all(all(v["equal"]) for k, v in result["references"].items() if k == "vllm") else 1


if __name__ == "__main__":
    sys.exit(main())
