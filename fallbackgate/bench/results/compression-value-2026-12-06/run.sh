# bash fallbackgate/bench/results/compression-value-2026-12-06/run.sh [--record]
# --record: first the joint traces again (every workload, RAM 0.25 and 0.5, seeds 60-64, against the SLO
# targets of seeds 50-59's sweep; about 4 min on 2 cores; they replace the committed ones). Then the
# compression what-ifs over the traces (about 2 min, 2 processes), the JSON, the figure and both tables.
set -e
cd "$(git rev-parse --show-toplevel)"
D=fallbackgate/bench/results/compression-value-2026-12-06
if [ "$1" = "--record" ]; then
  rm -rf "$D/traces"
  .venv/bin/fallbackgate sweep --workloads mixed,short-chat,long-retrieval,multi-turn,long-reasoning \
    --seeds 60,61,62,63,64 --held-out-seed 2 --controllers joint --keep-trace all \
    --slo-from fallbackgate/sweep_results/seeds50-59/sweep.json --out "$D" --ledger "sqlite:///$D/ledger.sqlite" \
    > "$D/sweep.log"
  rm -f "$D"/sweep-*.png "$D/anatomy.png" "$D"/ledger.sqlite*
fi
.venv/bin/python -m fallbackgate.bench.compression_value --sweep "$D/sweep.json" --jobs 2 \
  --json "$D/compression_value.json" --png "$D/compression_value.png" > "$D/compression_value.txt"
.venv/bin/python "$D/table.py" "$D/compression_value.json" > "$D/table-best-static.md"
.venv/bin/python "$D/table.py" "$D/compression_value.json" "two LRUs" > "$D/table-two-lrus.md"
