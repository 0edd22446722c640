#!/bin/bash
# bash fallbackgate/bench/results/ssd-sharing-2026-12-07/run-control.sh   (repository root; ~11 min, after run.sh)
# run.sh found two queues (one per kind, one worker each) stalling less than one shared queue of two workers while
# the KV blocks moved 0.4 % of the bytes; the control: the same cells with priority/shared, priority/by_kind and
# one shared queue with ONE worker (priority/shared/1), every layout three times per cell in rotated order, so each
# takes each place once (an earlier run with two repeats left the places unbalanced: control-2repeats.*).
set -euo pipefail
HERE=fallbackgate/bench/results/ssd-sharing-2026-12-07
TRACES=fallbackgate/bench/results/compression-value-2026-12-06/traces
SCRATCH=${SCRATCH:-/var/tmp/fg-ssd}
mkdir -p "$SCRATCH"
args=()
for seed in 60 61 62 63 64; do args+=(--trace "$TRACES/mixed_${seed}_joint_0.25_None"); done
echo "$(date -u +%FT%TZ) start control load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$HERE/times.txt"
python -m fallbackgate.bench.ssd_sharing "${args[@]}" --dir "$SCRATCH" --repeats 3 --workers 2 \
    --layouts priority/by_kind,priority/shared/1 \
    --json "$HERE/control.json" --png "$HERE/control.png" | tee "$HERE/control.txt"
echo "$(date -u +%FT%TZ) end   control load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$HERE/times.txt"
