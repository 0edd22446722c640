#!/bin/bash
# bash fallbackgate/bench/results/ssd-sharing-kv-2026-12-07/run.sh   (repository root; ~20 min, quiet machine)
# How experts and KV should share one disk when KV moves a real share of the bytes (PROBE.md, "also raised"):
# stop 55's question again (../ssd-sharing-2026-12-07, where KV was 0.41 % of the bytes) with the simulator's
# larger-KV what-if: every KV block 4 times its recorded bytes (a model with 4x the KV bytes per token against
# its experts), and 3 times each trace's recorded budget so that a layer's K/V of the batch fits (x4 at the
# recorded budget did not: the engine could not have served it; modelled-shares.txt). The mixed workload's
# joint traces at RAM 0.25 (seeds 60-64), decided again by joint and by a static split giving experts 0.9 of
# the budget, their transfers performed with O_DIRECT against a scratch file on this machine's disk under four
# layouts, each in each place once (4 repeats, rotated).
set -euo pipefail
HERE=fallbackgate/bench/results/ssd-sharing-kv-2026-12-07
TRACES=fallbackgate/bench/results/compression-value-2026-12-06/traces
SCRATCH=${SCRATCH:-/var/tmp/fg-ssd}
mkdir -p "$SCRATCH"
args=()
for seed in 60 61 62 63 64; do args+=(--trace "$TRACES/mixed_${seed}_joint_0.25_None"); done
echo "$(date -u +%FT%TZ) start kv x4 budget x3 load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$HERE/times.txt"
python -m fallbackgate.bench.ssd_sharing "${args[@]}" --dir "$SCRATCH" --kv-scale 4 --budget-scale 3 --repeats 4 \
    --workers 2 --layouts priority/shared,fifo/shared,priority/by_kind,priority/shared/1 \
    --json "$HERE/kv4.json" --png "$HERE/kv4.png" | tee "$HERE/kv4.txt"
echo "$(date -u +%FT%TZ) end   kv x4 budget x3 load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$HERE/times.txt"
