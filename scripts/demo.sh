#!/usr/bin/env bash
# A serving-only smoke run: start a local cluster, embed a sentence through the gateway, stop the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
LF=.venv/bin/lorafleet
$LF up --workers 1 --detach
trap '$LF down' EXIT
$LF status
$LF embed --model all-MiniLM-L6-v2 "Der Verkäufer ist verpflichtet, dem Käufer die Sache zu übergeben."
