#!/usr/bin/env bash
# The main job: start a local cluster, embed a sentence through the gateway, stop the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export LORAFLEET_DATA_DIR="${LORAFLEET_DATA_DIR:-$(cd .. && pwd)/shared/data}"
LF=.venv/bin/lorafleet
$LF up --workers 1 --detach
trap '$LF down' EXIT
$LF status
$LF embed --model all-MiniLM-L6-v2 "Der Verkäufer ist verpflichtet, dem Käufer die Sache zu übergeben."
