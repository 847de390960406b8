#!/usr/bin/env bash
# The main job: the statutes (fetched once), a research run on the default config (Optuna study of LoRA trainings, tracked in
# the local MLflow store; it ends by tuning and registering the winner as 'candidate'), then a
# local serving cluster (embedded nats-server), promotion of the winner, and a query to it.
# Extra arguments go to `lorafleet research run` (e.g. --trials 3 --budget-minutes 30).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
LF=.venv/bin/lorafleet

# The statutes: LORAFLEET_DATA_DIR if set, else the cache `lorafleet data fetch` fills (once).
if ! $LF data info >/dev/null 2>&1; then
  $LF data fetch
fi

$LF research run configs/german-legal.yaml "$@"
$LF registry list
$LF up --workers 1 --detach
trap '$LF down' EXIT
if $LF promote german-legal; then
  $LF embed --model german-legal "Kündigung des Arbeitsverhältnisses wegen dringender betrieblicher Erfordernisse"
else
  echo "no candidate passed the promotion gate; the base model keeps serving" >&2
  $LF embed --model all-MiniLM-L6-v2 "Kündigung des Arbeitsverhältnisses wegen dringender betrieblicher Erfordernisse"
fi
echo "compare the research runs and model versions: lorafleet ui  (see docs/mlflow-ui.md)"
