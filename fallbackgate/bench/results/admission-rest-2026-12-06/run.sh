# bash fallbackgate/bench/results/admission-rest-2026-12-06/run.sh: short chat, long retrieval and long reasoning,
# every controller (A: joint as shipped) then joint with lowbit_colder and the opened best-effort budget (B),
# seeds 60-64 then 65-69 -- stop 51's run.sh for the three workloads it did not run
set -e
cd /work/main
FB=.venv/bin/fallbackgate
SLO=fallbackgate/sweep_results/seeds50-59/sweep.json
BUD=fallbackgate/bench/results/lowbit-frontier-2026-12-06/best-effort-open.yaml
OUT=/tmp/s52/rest
COMMON="--workloads short-chat,long-retrieval,long-reasoning --held-out-seed 2"
COMMON="$COMMON --slo-from $SLO --ledger sqlite:///$OUT/ledger.sqlite"
mkdir -p $OUT
for part in 60,61,62,63,64 65,66,67,68,69; do
  tag=${part%%,*}
  $FB sweep $COMMON --seeds $part --out $OUT/A$tag
  $FB sweep $COMMON --seeds $part --controllers joint --expert-admission lowbit_colder --class-budgets $BUD --out $OUT/B$tag
done
echo ALLDONE
