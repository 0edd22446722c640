# bash fallbackgate/bench/results/admission-rest-2026-12-06/ab.sh: run after run per seed and workload (order
# rotated by seed), joint as shipped, with lowbit_colder anywhere and with lowbit_colder_decode (the opened
# best-effort budget both), long retrieval and long reasoning, seeds 60-65, RAM 0.25 then 0.5
set -e
cd /work/main
D=fallbackgate/bench/results/admission-rest-2026-12-06
BUD=fallbackgate/bench/results/lowbit-frontier-2026-12-06/best-effort-open.yaml
for ram in 0.25 0.5; do
  .venv/bin/python -m fallbackgate.bench.interleaved_ab --seeds 60,61,62,63,64,65 \
    --workloads long-retrieval,long-reasoning --ram-frac $ram \
    --slo-from fallbackgate/sweep_results/seeds50-59/sweep.json \
    --variant shipped=exact --variant anywhere=lowbit_colder:$BUD --variant decode=lowbit_colder_decode:$BUD \
    --metrics ttft_p50_ms,tpot_p50_ms,tpot_p99_ms,slo_attainment,over_belady_same_room,lowbit_uses,mean_kl \
    --out $D/ab-$ram.json > $D/ab-$ram.txt
done
