#!/bin/bash
# bash fallbackgate/bench/results/ssd-sharing-2026-12-07/run.sh   (repository root; ~10 min on a quiet machine)
# How read-only experts and append-only KV pages should share one disk (PROBE.md, "also raised"): the mixed
# workload's joint traces at RAM 0.25 (seeds 60-64, recorded at stop 53: bench/results/compression-value-2026-12-06),
# decided again by joint and by a static split giving experts 0.9 of the budget (the split that spills the most KV),
# their transfers performed for real with O_DIRECT against a scratch file on this machine's disk, under four ways of
# sharing it (queue order priority|fifo x one queue shared|by_kind), 2 transfers in flight in all, every layout
# twice per cell in rotated order.
set -euo pipefail
HERE=fallbackgate/bench/results/ssd-sharing-2026-12-07
TRACES=fallbackgate/bench/results/compression-value-2026-12-06/traces
SCRATCH=${SCRATCH:-/var/tmp/fg-ssd}
mkdir -p "$SCRATCH"
args=()
for seed in 60 61 62 63 64; do args+=(--trace "$TRACES/mixed_${seed}_joint_0.25_None"); done
echo "$(date -u +%FT%TZ) start load $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$HERE/times.txt"
python -m fallbackgate.bench.ssd_sharing "${args[@]}" --dir "$SCRATCH" --repeats 2 --workers 2 \
    --json "$HERE/ssd_sharing.json" --png "$HERE/ssd_sharing.png" | tee "$HERE/ssd_sharing.txt"
echo "$(date -u +%FT%TZ) end   load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$HERE/times.txt"
