# bash run3.sh: joint with lowbit_colder (B2) and lowbit_colder_decode (E), best-effort opened, mixed and multi-turn, interleaved parts
set -e
cd /work/main
FB=.venv/bin/fallbackgate
SLO=fallbackgate/sweep_results/seeds50-59/sweep.json
BUD=fallbackgate/bench/results/lowbit-frontier-2026-12-06/best-effort-open.yaml
COMMON="--workloads mixed,multi-turn --held-out-seed 2 --slo-from $SLO --ledger sqlite:////tmp/s50/open/ledger.sqlite --controllers joint --class-budgets $BUD"
for part in 60,61,62,63,64 65,66,67,68,69; do
  tag=${part%%,*}
  $FB sweep $COMMON --seeds $part --expert-admission lowbit_colder --out /tmp/s50/open/B2$tag
  $FB sweep $COMMON --seeds $part --expert-admission lowbit_colder_decode --out /tmp/s50/open/E$tag
done
echo ALLDONE
