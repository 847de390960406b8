#!/usr/bin/env bash
# GPU check (issue 27): on a CUDA machine, in about 8 minutes, install what is needed (the repo's setup and a
# CUDA build of torch), run the gpu-marked tests, and benchmark serving and generation at fp16/bf16 against fp32.
# Every result is JSON in the output folder (first argument, else $OUT, else bench/results/gpu-check):
#   gpu-check.json             the summary: GPU, torch/CUDA versions, each step's exit status and seconds
#   gpu-tests.xml              the gpu-marked tests (JUnit XML)
#   serve.json                 bench/serve.py --device cuda: raw encode and the cluster at fp32, fp16, bf16
#   generate-precision.json    greedy generation (packaged SmolLM2-135M) at fp32, fp16, bf16: tokens/s, agreement
# On a machine without CUDA it says so and exits 0 before installing anything.
#
#   bash scripts/gpu-check.sh [OUT_DIR]
#   GPU_CHECK_BUDGET_S=480  the whole run's budget; each step gets what is left of it
#   TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128   where the CUDA build of torch comes from
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-bench/results/gpu-check}}
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
TORCH_CUDA_INDEX=${TORCH_CUDA_INDEX:-https://download.pytorch.org/whl/cu128}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
SUMMARY="$OUT_DIR/gpu-check.json"
START=$(date +%s)
STEPS=""  # "name rc seconds" lines, turned into JSON at the end

left() { echo $((BUDGET_S - ($(date +%s) - START))); }

json_str() {  # a JSON string literal of $1 (no python needed: runs before anything is installed)
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/ }
  printf '"%s"' "$s"
}

write_summary() {  # $1: cuda true|false, $2: a sentence
  local steps="" name rc secs
  while read -r name rc secs; do
    [ -n "$name" ] || continue
    steps+="${steps:+, }{\"step\": $(json_str "$name"), \"rc\": $rc, \"seconds\": $secs}"
  done <<< "$STEPS"
  printf '{"check": "gpu", "cuda": %s, "message": %s, "gpu": %s, "torch": %s, "steps": [%s], "wall_s": %s}\n' \
    "$1" "$(json_str "$2")" "$(json_str "${GPU_NAME:-}")" "$(json_str "${TORCH_INFO:-}")" "$steps" \
    "$(($(date +%s) - START))" > "$SUMMARY"
}

step() {  # step NAME MAX_S CMD...: runs CMD under what is left of the budget (at most MAX_S), records rc and time
  local name=$1 max=$2 t0 rc budget
  shift 2
  budget=$(left)
  [ "$budget" -lt "$max" ] && max=$budget
  if [ "$max" -le 10 ]; then
    echo "gpu-check: skipping $name: the ${BUDGET_S}s budget is spent" >&2
    STEPS+="$name 124 0"$'\n'
    return 124
  fi
  echo "gpu-check: $name (up to ${max}s)…" >&2
  t0=$(date +%s)
  timeout --signal=TERM --kill-after=20 "$max" "$@"
  rc=$?
  STEPS+="$name $rc $(($(date +%s) - t0))"$'\n'
  echo "gpu-check: $name exited $rc after $(($(date +%s) - t0))s" >&2
  return $rc
}

# 1. Is there a CUDA device at all? Checked before installing anything (nvidia-smi ships with the driver).
if ! command -v nvidia-smi > /dev/null 2>&1; then
  MSG="no CUDA device here: nvidia-smi (the NVIDIA driver) is not installed, so there is nothing to check on a GPU; the CPU benchmarks are bench/serve.py and bench/train.py"
  echo "gpu-check: $MSG"
  write_summary false "$MSG"
  exit 0
fi
if ! GPU_NAME=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2> /dev/null) || [ -z "$GPU_NAME" ]; then
  MSG="no CUDA device here: nvidia-smi lists no GPU (driver not loaded, or no device visible to this machine)"
  echo "gpu-check: $MSG"
  write_summary false "$MSG"
  exit 0
fi
GPU_NAME=$(echo "$GPU_NAME" | head -1)
echo "gpu-check: $GPU_NAME"

# 2. The repo's setup (only when the venv is missing), then a CUDA build of torch at the pinned version.
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  step setup 240 bash scripts/setup.sh || { write_summary true "setup failed"; exit 1; }
fi
cuda_of_torch() { "$PY" -c 'import torch; print(torch.version.cuda or "", torch.cuda.is_available())' 2> /dev/null; }
if [ "$(cuda_of_torch | cut -d' ' -f1)" = "" ]; then
  TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
  step torch-cuda 240 "$PY" -m pip install -q --force-reinstall --no-deps "torch==$TORCH_VERSION" \
    --index-url "$TORCH_CUDA_INDEX" || { write_summary true "installing torch $TORCH_VERSION from $TORCH_CUDA_INDEX failed"; exit 1; }
fi
read -r TORCH_CUDA TORCH_SEES_GPU <<< "$(cuda_of_torch)"
TORCH_INFO="torch $("$PY" -c 'import torch; print(torch.__version__)') CUDA ${TORCH_CUDA:-none}"
if [ "$TORCH_SEES_GPU" != "True" ]; then
  MSG="nvidia-smi lists $GPU_NAME but torch ($TORCH_INFO) sees no CUDA device: check the driver against the CUDA build"
  echo "gpu-check: $MSG"
  write_summary false "$MSG"
  exit 1
fi
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1

# 3. The gpu-marked tests (pytest exits 5 when none is collected).
step gpu-tests 150 "$PY" -m pytest -q -p no:cacheprovider -p no:rerunfailures -m gpu tests \
  --junitxml "$OUT_DIR/gpu-tests.xml"

# 4. Serving: raw encode and the cluster on the GPU at fp32, fp16 and bf16, side by side.
step serve 150 "$PY" -m lorafleet.bench.serve --device cuda --contenders lorafleet --precision fp32,fp16,bf16 \
  --concurrency 1 --concurrency 32 --point-s 5 --batch-sizes 1,32,128 --ceiling-batch-sizes 32,128 \
  --out "$OUT_DIR/serve.json"

# 5. Generation: the packaged SmolLM2-135M, greedy, at each precision against fp32 (speed and text agreement).
step generate 120 "$PY" - "$OUT_DIR/generate-precision.json" << 'EOF'
import json, sys, time
from pathlib import Path

import torch

from transformers import AutoModelForCausalLM, AutoTokenizer

from lorafleet.models.causal import resolve_causal_source

source = resolve_causal_source("SmolLM2-135M-Instruct")  # the packaged GGUF, converted to a float32 folder once

prompts = [f"Summarise in one sentence: Section {i} of the tenancy law says the landlord must return the deposit "
           "within six months after the tenancy ends." for i in range(16)]
out = {"model": str(source), "gpu": torch.cuda.get_device_name(0), "max_new_tokens": 48, "prompts": len(prompts),
       "precisions": {}}
texts = {}
tok = AutoTokenizer.from_pretrained(source)
tok.padding_side = "left"
if tok.pad_token is None:
    tok.pad_token = tok.eos_token
for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
    model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=dtype).to("cuda").eval()
    batch = tok(prompts, return_tensors="pt", padding=True).to("cuda")
    with torch.inference_mode():
        model.generate(**batch, max_new_tokens=4, do_sample=False)  # warm up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen = model.generate(**batch, max_new_tokens=48, do_sample=False)
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
    new = gen[:, batch["input_ids"].shape[1]:]
    texts[name] = tok.batch_decode(new, skip_special_tokens=True)
    out["precisions"][name] = {"tokens_per_s": round(int((new != tok.pad_token_id).sum()) / secs, 1),
                               "seconds": round(secs, 3),
                               "exact_match_vs_fp32": sum(a == b for a, b in zip(texts[name], texts["fp32"]))
                               / len(prompts)}
    del model
    torch.cuda.empty_cache()
Path(sys.argv[1]).write_text(json.dumps(out, indent=2))
print(json.dumps(out["precisions"]))
EOF

FAILED=$(awk '$2 != 0 && !($1 == "gpu-tests" && $2 == 5) {print $1}' <<< "$STEPS" | tr '\n' ' ')
if [ -n "$FAILED" ]; then
  write_summary true "done on $GPU_NAME; steps that failed or ran out of time: $FAILED(see their output)"
  echo "gpu-check: results in $OUT_DIR; failed: $FAILED"
  exit 1
fi
write_summary true "done on $GPU_NAME: results in $OUT_DIR"
echo "gpu-check: all steps passed; results in $OUT_DIR"
