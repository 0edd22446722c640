#!/bin/bash
# bash fallbackgate/bench/results/compression-real-2026-12-06/rerun-audit-fix.sh   (after run.sh; ~7 min)
# The bf16-2x seeds whose gates failed in run.sh (122, 124, 125, 126, 129), every controller, both budgets, again
# with the replay's bf16 router near-tie window (7ef029d; the floor widening in that commit was reverted in the
# next), against bf16-2x's SLO targets and the fp32 runs' RAM bytes.
set -euo pipefail
HERE=fallbackgate/bench/results/compression-real-2026-12-06
BF16=${BF16:-/tmp/fg-tinymoe-bf16}
python -m fallbackgate.sweep.merge $HERE/fp32/p1/sweep.json $HERE/fp32/p2/sweep.json --out /tmp/fg-fp32-merged/sweep.json > /dev/null
mkdir -p $HERE/bf16-2x/rerun-audit-fix
fallbackgate sweep --workloads mixed --held-out-seed 122 --ram-fracs 0.25,0.5 --ledger sqlite:////tmp/fg-compression-real.sqlite \
    --model "$BF16" --seeds 122,124,125,126,129 --ram-basis-from /tmp/fg-fp32-merged/sweep.json \
    --mixed-requests 16 --time-scale 0.125 --max-num-seqs 16 --slo-from $HERE/bf16-2x/p1/sweep.json \
    --out $HERE/bf16-2x/rerun-audit-fix > $HERE/bf16-2x/rerun-audit-fix/log.txt 2>&1
