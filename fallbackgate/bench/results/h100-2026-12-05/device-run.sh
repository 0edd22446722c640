#!/usr/bin/env bash
# bash .whl/run.sh  (device machine, repo root): gpu-check, then the MoE-layer benchmark, then the demo on CUDA
# .whl/site.tar.xz (not kept: 15 MiB): the wheels the machine lacked (transformers 5.25.0, huggingface_hub 2.4.0,
# httpx2/httpcore2, pydantic 2.14.4, SQLAlchemy 2.1.9, alembic, Mako, ...) downloaded here for cp312, unpacked, xz-packed.
set -o pipefail
R=$PWD
mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/site.tar.xz || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 USE_HUB_KERNELS=0 HF_HUB_OFFLINE=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; python3 --version; } > $OUT/env.txt 2>&1
t0=$(date +%s)
timeout 240 bash .ci/gpu-check 2>&1 | tee $OUT/gpu-check.log; echo "gpu-check rc=$? in $(( $(date +%s) - t0 )) s" | tee -a $OUT/gpu-check.log
cp /tmp/gpu-check.json $OUT/ 2>/dev/null
cd /tmp
t0=$(date +%s)
python3 -m fallbackgate.synth --like qwen3-30b-a3b --num-layers 2 --out /tmp/qwen3 >/dev/null 2>&1 && \
python3 -m fallbackgate.synth --like deepseek-v2-lite --num-layers 2 --out /tmp/dsv2 >/dev/null 2>&1
echo "synth rc=$? in $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 200 python3 -m fallbackgate.bench.moe_layer --model /tmp/qwen3 --model /tmp/dsv2 --json $OUT/bench-moe-layer.json 2>&1 | tee $OUT/moe-layer.log
echo "moe_layer rc=$? in $(( $(date +%s) - t0 )) s" | tee -a $OUT/moe-layer.log
t0=$(date +%s)
timeout 60 python3 -m fallbackgate run --ledger sqlite:////tmp/demo.sqlite --quiet --json $OUT/demo-cuda.json > $OUT/demo-cuda.log 2>&1
echo "demo rc=$? in $(( $(date +%s) - t0 )) s"; tail -8 $OUT/demo-cuda.log
