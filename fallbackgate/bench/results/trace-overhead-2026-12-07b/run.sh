#!/bin/bash
# bash fallbackgate/bench/results/trace-overhead-2026-12-07b/run.sh — the live trace's cost on a quiet machine with
# enough pairs to decide (issue 24: <= 3 % tokens/s on the bundled model at batch 8): the machine's own speed swings
# (a bare matmul's time varies 2x over seconds here) give single pairs a 9-10 % spread, so 240 pairs of 128-token
# answers and 400 of 32-token ones; run from the repository root, nothing else running.
set -euo pipefail
OUT=fallbackgate/bench/results/trace-overhead-2026-12-07b
uptime > $OUT/load.txt
python -m fallbackgate.bench.trace_overhead --json $OUT/tokens128.json --reps 240 --max-new-tokens 128 | tee $OUT/tokens128.txt
uptime >> $OUT/load.txt
python -m fallbackgate.bench.trace_overhead --json $OUT/tokens32.json --reps 400 --max-new-tokens 32 | tee $OUT/tokens32.txt
uptime >> $OUT/load.txt
