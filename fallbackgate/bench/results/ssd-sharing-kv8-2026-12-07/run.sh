#!/bin/bash
# bash fallbackgate/bench/results/ssd-sharing-kv8-2026-12-07/run.sh   (repository root; ~9 min)
# Experts and a KV that moves over a third of the disk's bytes (PROBE.md, "also raised"), after ../ssd-sharing-kv-2026-12-07
# (KV x4 at 3x the budget: 15 % of the static split's bytes). Every KV block 8 times its recorded bytes, at 6x
# each trace's recorded budget, the smallest multiple where a layer's K/V of the batch fits on every seed
# of those tried (modelled.txt, seeds 60-62: x4 and x5 do not fit seed 62). The mixed workload's joint traces at RAM 0.25 (seeds 60-64),
# decided again by the static split (expert share 0.9: experts get all they can hold, KV the rest; joint keeps
# KV on device here and moves 0-1.2 % KV at x6, modelled), their transfers performed with O_DIRECT against a scratch file
# on this machine's disk under four layouts, each in each place once (4 repeats, rotated).
set -euo pipefail
HERE=fallbackgate/bench/results/ssd-sharing-kv8-2026-12-07
TRACES=fallbackgate/bench/results/compression-value-2026-12-06/traces
SCRATCH=${SCRATCH:-/var/tmp/fg-ssd}
mkdir -p "$SCRATCH"
args=()
for seed in 60 61 62 63 64; do args+=(--trace "$TRACES/mixed_${seed}_joint_0.25_None"); done
echo "$(date -u +%FT%TZ) start kv x8 budget x6 load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$HERE/times.txt"
python -m fallbackgate.bench.ssd_sharing "${args[@]}" --dir "$SCRATCH" --kv-scale 8 --budget-scale 6 --repeats 4 \
    --controllers static_split --workers 2 \
    --layouts priority/shared,fifo/shared,priority/by_kind,priority/shared/1 \
    --json "$HERE/kv8.json" --png "$HERE/kv8.png" | tee "$HERE/kv8.txt"
echo "$(date -u +%FT%TZ) end   kv x8 budget x6 load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$HERE/times.txt"
