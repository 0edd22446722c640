#!/bin/bash
# bash fallbackgate/bench/results/ssd-sharing-kv-2026-12-07/modelled-shares.sh   (repository root; ~4 min)
# The larger-KV what-if priced on the device model each trace's own waits fit (no real I/O), to choose what
# run.sh performs for real: for KV x1, x2, x4, x8, x16 at the recorded budget and at 3x it, mixed seeds 60-62 at
# RAM 0.25, decided by joint and by the static split with experts at 0.9 — the KV share of the bytes moved, and
# how many layer gathers did not fit the budget (num_unfit_gathers > 0: a run the engine could not serve).
set -euo pipefail
HERE=fallbackgate/bench/results/ssd-sharing-kv-2026-12-07
TRACES=fallbackgate/bench/results/compression-value-2026-12-06/traces
for seed in 60 61 62; do
    T="$TRACES/mixed_${seed}_joint_0.25_None"
    budget=$(python -c "import json; print(json.load(open('$T/metadata.json'))['budgets']['device_bytes'])")
    gib=$(python -c "print(f'{$budget / 2**30!r},{3 * $budget / 2**30!r}')")
    fallbackgate trace simulate "$T" --out "$HERE/modelled-$seed.json" --controllers static_split,joint \
        --expert-fractions 0.9 --devices waits --compress 1:1,1:2,1:4,1:8,1:16 --budget-gib "$gib" --jobs 2 > /dev/null
done
python -m fallbackgate.bench.kv_shares "$HERE"/modelled-6?.json | tee "$HERE/modelled-shares.txt"
