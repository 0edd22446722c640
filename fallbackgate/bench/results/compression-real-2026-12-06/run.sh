#!/bin/bash
# bash fallbackgate/bench/results/compression-real-2026-12-06/run.sh   (from the repository root; ~60 min on 2 cores)
# Model-side compression in the engine: the bundled fp32 model and its bf16 copy (python -m fallbackgate.synth.cast),
# mixed workload, seeds 120-129 (122 held out), every controller, three conditions:
#   fp32        RAM 0.25 and 0.5 of the fp32 model's own demand (all routed experts + every request's full-length KV)
#   bf16        RAM 0.25 and 0.5 of the bf16 copy's own demand, which is exactly half the fp32 one: bf16@0.25 has
#               fp32@0.25's pressure (the saved memory taken away), bf16@0.5 has fp32@0.25's bytes (the saved
#               memory left free); fp32@0.5's bytes would hold the whole bf16 copy and are not run
#   bf16-2x     the bf16 copy in the fp32 runs' RAM bytes (--ram-basis-from) serving 16 requests at twice the rate,
#               16 decoded together: the saved memory spent on concurrency (other requests than the 8 of a seed)
# Two parts of five seeds; a part whose sweep.json exists is not run again. Order: part 1 fp32, bf16, bf16-2x;
# part 2 bf16, fp32, bf16-2x (bf16-2x needs the fp32 part's demand, so it runs last in both). Part 2 of each
# condition uses part 1's SLO targets (--slo-from). Then the analysis (python -m fallbackgate.bench.compression_real)
# and the copy's own quality (python -m fallbackgate.bench.cast_quality), at the end of this script.
set -euo pipefail
HERE=fallbackgate/bench/results/compression-real-2026-12-06
BF16=${BF16:-/tmp/fg-tinymoe-bf16}
LEDGER=${LEDGER:-sqlite:////tmp/fg-compression-real.sqlite}
rm -rf "$BF16"
python -m fallbackgate.synth.cast --model fallbackgate/tinymoe/checkpoint --dtype bf16 --out "$BF16"
COMMON=(--workloads mixed --held-out-seed 122 --ram-fracs 0.25,0.5 --ledger "$LEDGER")
P1=120,121,122,123,124
P2=125,126,127,128,129

sweep() {  # condition part extra-args...
    local cond=$1 part=$2; shift 2
    if [ -f "$HERE/$cond/$part/sweep.json" ]; then echo "kept $cond $part"; return; fi
    mkdir -p "$HERE/$cond/$part"
    echo "$(date -u +%FT%TZ) start $cond $part load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$HERE/times.txt"
    fallbackgate sweep "${COMMON[@]}" "$@" --out "$HERE/$cond/$part" > "$HERE/$cond/$part/log.txt" 2>&1
    echo "$(date -u +%FT%TZ) end   $cond $part load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$HERE/times.txt"
}
twice() {  # part seeds extra-args...
    sweep bf16-2x "$1" --model "$BF16" --seeds "$2" --ram-basis-from "$HERE/fp32/$1/sweep.json" \
        --mixed-requests 16 --time-scale 0.125 --max-num-seqs 16 "${@:3}"
}

sweep fp32 p1 --seeds $P1
sweep bf16 p1 --model "$BF16" --seeds $P1
twice p1 $P1
sweep bf16 p2 --model "$BF16" --seeds $P2 --slo-from "$HERE/bf16/p1/sweep.json"
sweep fp32 p2 --seeds $P2 --slo-from "$HERE/fp32/p1/sweep.json"
twice p2 $P2 --slo-from "$HERE/bf16-2x/p1/sweep.json"

python -m fallbackgate.bench.compression_real --condition fp32=$HERE/fp32/p1/sweep.json,$HERE/fp32/p2/sweep.json \
    --condition bf16=$HERE/bf16/p1/sweep.json,$HERE/bf16/p2/sweep.json \
    --condition bf16-2x=$HERE/bf16-2x/p1/sweep.json,$HERE/bf16-2x/p2/sweep.json \
    --json $HERE/compression_real.json --png $HERE/compression_real.png | tee $HERE/compression_real.txt
python -m fallbackgate.bench.cast_quality --compressed "$BF16" --json $HERE/cast_quality.json | tee $HERE/cast_quality.txt
