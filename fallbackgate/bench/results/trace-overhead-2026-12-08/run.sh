#!/bin/bash
# bash fallbackgate/bench/results/trace-overhead-2026-12-08/run.sh — the live trace's cost after 23ec892 made it
# cheaper (issue 24: <= 3 % tokens/s on the bundled model at batch 8). Declared before it ran: one run of 400 pairs
# of 128-token answers (the length the last runs left undecided), judged as the benchmark judges it and not pooled
# with earlier runs (other code); then 400 pairs of 32-token answers as a check that the shorter length stays met.
# Run from the repository root, nothing else running.
set -euo pipefail
OUT=fallbackgate/bench/results/trace-overhead-2026-12-08
git rev-parse HEAD > $OUT/commit.txt
uptime > $OUT/load.txt
python -m fallbackgate.bench.trace_overhead --json $OUT/tokens128.json --reps 400 --max-new-tokens 128 | tee $OUT/tokens128.txt
uptime >> $OUT/load.txt
python -m fallbackgate.bench.trace_overhead --json $OUT/tokens32.json --reps 400 --max-new-tokens 32 | tee $OUT/tokens32.txt
uptime >> $OUT/load.txt
