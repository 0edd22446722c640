#!/bin/bash
# bash fallbackgate/bench/results/ssd-sharing-kv8-2026-12-07/modelled.sh   (repository root; ~40 s)
# KV x8 priced on the device model each trace's own waits fit (no real I/O), to choose the budget run.sh performs:
# mixed seeds 60-62 at RAM 0.25, 4x, 5x, 6x and 8x each trace's recorded budget, the static split at expert share
# 0.5, 0.7 and 0.9 and joint — the KV share of the bytes moved, the modelled stall, and how many layer gathers did
# not fit the budget (num_unfit_gathers > 0: a run the engine could not serve).
set -euo pipefail
HERE=fallbackgate/bench/results/ssd-sharing-kv8-2026-12-07
TRACES=fallbackgate/bench/results/compression-value-2026-12-06/traces
for seed in 60 61 62; do
    T="$TRACES/mixed_${seed}_joint_0.25_None"
    budget=$(python -c "import json; print(json.load(open('$T/metadata.json'))['budgets']['device_bytes'])")
    gib=$(python -c "print(','.join(repr(k * $budget / 2**30) for k in (4, 5, 6, 8)))")
    fallbackgate trace simulate "$T" --out "$HERE/modelled-$seed.json" --controllers static_split,joint \
        --expert-fractions 0.5,0.7,0.9 --devices waits --compress 1:8 --budget-gib "$gib" --jobs 2 > /dev/null
done
python -m fallbackgate.bench.kv_shares "$HERE"/modelled-6?.json | tee "$HERE/modelled.txt"
