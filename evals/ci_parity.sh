#!/usr/bin/env bash
# CI parity check on a small slice (10 items per task, fully offline):
#  1. the exact policy must agree with the exact baseline on every item (tolerances default to exact parity);
#  2. one approximate policy (int4 KV reads forced) must pass the tolerances its file declares.
# Uses the bundled trained checkpoint when present, else a random test checkpoint. Exit non-zero on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
model=fallbackgate/tinymoe/checkpoint
if [ ! -f "$model/config.json" ]; then
  model="$work/ckpt"
  "$PY" -c "from tests.checkpoints import make_checkpoint; make_checkpoint('qwen3_moe', '$model')"
fi
tasks=fg_cloze,fg_rolling_ppl,fg_names
limit=${FALLBACKGATE_PARITY_LIMIT:-10}
"$PY" -m fallbackgate.cli parity --policy fallbackgate/policies/exact.yaml --tasks "$tasks" --limit "$limit" \
  --model "$model" --ledger "sqlite:///$work/ledger.db" --report-dir "$work/exact"
# 64-token chunks: later chunks of a window attend over the int4 copies of earlier chunks' KV
"$PY" -m fallbackgate.cli parity --policy evals/policies/ci_kv_int4.yaml --force kv_dequant --chunk-tokens 64 --tasks "$tasks" \
  --limit "$limit" --model "$model" --ledger "sqlite:///$work/ledger.db" --report-dir "$work/approx"
