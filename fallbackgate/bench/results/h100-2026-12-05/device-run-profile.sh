#!/usr/bin/env bash
# bash .whl/run2.sh  (device machine, repo root): torch.profiler over bench.moe_layer's qwen3 batch-32 pair
# .whl/site.tar.xz: as in device-run.sh beside this file.
set -o pipefail
R=$PWD
mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/site.tar.xz || exit 3
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . 2>&1 | tail -2
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 USE_HUB_KERNELS=0 HF_HUB_OFFLINE=1
cd /tmp
python3 -m fallbackgate.synth --like qwen3-30b-a3b --num-layers 2 --out /tmp/qwen3 >/dev/null 2>&1 || exit 4
timeout 150 python3 $R/fallbackgate/bench/results/h100-2026-12-05/moe_layer_profile.py /tmp/qwen3 $OUT 32 2>&1 | tee $OUT/profile-b32.log
timeout 60 python3 $R/fallbackgate/bench/results/h100-2026-12-05/moe_layer_profile.py /tmp/qwen3 $OUT 8 2>&1 | tee $OUT/profile-b8.log
