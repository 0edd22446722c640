# bash fallbackgate/bench/results/admission-rest-2026-12-06/ab-mixed.sh: run after run per seed (order rotated by
# seed), joint as shipped and with lowbit_colder (the opened best-effort budget), mixed, seeds 60-79, RAM 0.25
set -e
cd /work/main
D=fallbackgate/bench/results/admission-rest-2026-12-06
BUD=fallbackgate/bench/results/lowbit-frontier-2026-12-06/best-effort-open.yaml
.venv/bin/python -m fallbackgate.bench.interleaved_ab --seeds $(seq -s, 60 79) --workloads mixed --ram-frac 0.25 \
  --slo-from fallbackgate/sweep_results/seeds50-59/sweep.json \
  --variant shipped=exact --variant admission=lowbit_colder:$BUD \
  --metrics ttft_p50_ms,tpot_p50_ms,tpot_p99_ms,slo_attainment,over_belady_same_room,lowbit_uses,mean_kl \
  --out $D/ab-mixed-0.25.json > $D/ab-mixed-0.25.txt
