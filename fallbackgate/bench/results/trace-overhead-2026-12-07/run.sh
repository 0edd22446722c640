#!/bin/bash
# bash fallbackgate/bench/results/trace-overhead-2026-12-07/run.sh — the live trace's cost on a quiet machine
# (issue 24: <= 3 % tokens/s on the bundled model at batch 8), run from the repository root after the sweep,
# nothing else running; 32- and 128-token answers, interleaved untraced/traced pairs.
set -euo pipefail
OUT=fallbackgate/bench/results/trace-overhead-2026-12-07
uptime > $OUT/load.txt
python -m fallbackgate.bench.trace_overhead --json $OUT/tokens32.json --reps 61 --max-new-tokens 32 | tee $OUT/tokens32.txt
uptime >> $OUT/load.txt
python -m fallbackgate.bench.trace_overhead --json $OUT/tokens128.json --reps 31 --max-new-tokens 128 | tee $OUT/tokens128.txt
uptime >> $OUT/load.txt
