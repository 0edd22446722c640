#!/bin/bash
# bash fallbackgate/bench/results/trace-overhead-2026-12-07b/run-more128.sh — 240 more pairs of 128-token answers,
# same code (71b9fcc) and machine, run because the first 240 (tokens128.json) left the goal undecided; the README
# reports each part and the two pooled, saying so (pooled afterwards with the --pool option c2d5e67 added, below).
set -euo pipefail
OUT=fallbackgate/bench/results/trace-overhead-2026-12-07b
uptime >> $OUT/load.txt
python -m fallbackgate.bench.trace_overhead --json $OUT/tokens128-more.json --reps 240 --max-new-tokens 128 | tee $OUT/tokens128-more.txt
uptime >> $OUT/load.txt
python -m fallbackgate.bench.trace_overhead --json $OUT/tokens128-pooled.json --pool $OUT/tokens128.json $OUT/tokens128-more.json | tee $OUT/tokens128-pooled.txt
