#!/bin/bash
# bash fallbackgate/bench/results/compression-real-2026-12-06/seed129-near-tie/run.sh   (repository root; ~3 min)
# Run 321's 16 requests (bf16-2x seed 129; prompts, classes, lengths and policy as its ledger rows recorded them:
# prompts-run321.jsonl, policy-run321.yaml with controller exact_lru) served again all in RAM with exact_lru,
# audited inline, at --max-num-seqs 16 and 1. gate-*-before.txt: at 1ee6be5 (the gate of stop 54);
# gate-*-after.txt: exact requests failing against the baseline replayed and judged against a replay that followed
# router near-ties (stop 55). Then the request alone at batch 1 with a deferred audit: gate-deferred.txt (an audit
# worker's verdict) and replay-batch1.txt (replay_request.py: KL against the baseline and the replay per position).
set -euo pipefail
HERE=fallbackgate/bench/results/compression-real-2026-12-06/seed129-near-tie
BF16=${BF16:-/tmp/fg-tinymoe-bf16}
[ -d "$BF16" ] || python -m fallbackgate.synth.cast --model fallbackgate/tinymoe/checkpoint --dtype bf16 --out "$BF16"
for n in 16 1; do
    rm -f /tmp/fg-seed129-$n.sqlite
    fallbackgate run --policy $HERE/policy-run321.yaml --model "$BF16" --prompts $HERE/prompts-run321.jsonl \
        --max-num-seqs $n --controller exact_lru --audit-rate 1 --audit inline \
        --ledger sqlite:////tmp/fg-seed129-$n.sqlite --quiet | awk '/^request +served/{p=1} p{print} /^run 1 \(complete/{p=0}' \
        > $HERE/gate-batch$n-after.txt
done
rm -f /tmp/fg-seed129-d1.sqlite
grep '"multi-turn-s0000-t0"' $HERE/prompts-run321.jsonl > /tmp/fg-seed129-t0.jsonl
fallbackgate run --policy $HERE/policy-run321.yaml --model "$BF16" --prompts /tmp/fg-seed129-t0.jsonl --max-num-seqs 1 \
    --controller exact_lru --audit-rate 1 --audit deferred --ledger sqlite:////tmp/fg-seed129-d1.sqlite --quiet > /dev/null
fallbackgate audit --ledger sqlite:////tmp/fg-seed129-d1.sqlite
fallbackgate gate --ledger sqlite:////tmp/fg-seed129-d1.sqlite --run 1 > $HERE/gate-deferred.txt || true
python $HERE/replay_request.py sqlite:////tmp/fg-seed129-d1.sqlite "$BF16" > $HERE/replay-batch1.txt
