# bash run2.sh: as run.sh, for short-chat, long-retrieval and long-reasoning
set -e
cd /work/main
while ! grep -q ALLDONE /tmp/s50/open/run.log; do sleep 5; done
FB=.venv/bin/fallbackgate
SLO=fallbackgate/sweep_results/seeds50-59/sweep.json
BUD=fallbackgate/bench/results/lowbit-frontier-2026-12-06/best-effort-open.yaml
COMMON="--workloads short-chat,long-retrieval,long-reasoning --held-out-seed 2 --slo-from $SLO --ledger sqlite:////tmp/s50/open/ledger.sqlite"
for part in 60,61,62,63,64 65,66,67,68,69; do
  tag=${part%%,*}
  $FB sweep $COMMON --seeds $part --out /tmp/s50/open/C$tag
  $FB sweep $COMMON --seeds $part --controllers joint --expert-admission lowbit_colder --class-budgets $BUD --out /tmp/s50/open/D$tag
done
echo ALLDONE
