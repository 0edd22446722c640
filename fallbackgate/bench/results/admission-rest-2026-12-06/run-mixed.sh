# bash fallbackgate/bench/results/admission-rest-2026-12-06/run-mixed.sh: the mixed workload alone, RAM 0.25 and
# 0.5, every controller (A) then joint with lowbit_colder and the opened best-effort budget (B), seeds 70-99 in
# parts of five -- to be pooled with stop 51's seeds 60-69 (same machine, same engine code)
set -e
cd /work/main
FB=.venv/bin/fallbackgate
SLO=fallbackgate/sweep_results/seeds50-59/sweep.json
BUD=fallbackgate/bench/results/lowbit-frontier-2026-12-06/best-effort-open.yaml
OUT=/tmp/s52/mixed
COMMON="--workloads mixed --held-out-seed 2"
COMMON="$COMMON --slo-from $SLO --ledger sqlite:///$OUT/ledger.sqlite"
mkdir -p $OUT
for part in 70,71,72,73,74 75,76,77,78,79 80,81,82,83,84 85,86,87,88,89 90,91,92,93,94 95,96,97,98,99; do
  tag=${part%%,*}
  $FB sweep $COMMON --seeds $part --out $OUT/A$tag
  $FB sweep $COMMON --seeds $part --controllers joint --expert-admission lowbit_colder --class-budgets $BUD --out $OUT/B$tag
done
echo ALLDONE
