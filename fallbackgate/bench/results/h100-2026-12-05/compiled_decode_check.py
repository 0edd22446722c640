"""python3 fallbackgate/bench/results/h100-2026-12-05/compiled_decode_check.py OUT.json

The compiled decode (hardware.compile_decode) against the eager engine on whatever device the engine picks (CUDA
where there is one): tokens equal, tokens/s of each, compile seconds. Prepared for the H100; no machine was lent
for it (the CPU run here: compiled-decode-cpu.json)."""

import json
import statistics
import sys
import time

import torch

from fallbackgate.bench.decode import _prompts, run_engine
from fallbackgate.bench.engines import exact_assembly
from fallbackgate.tinymoe import CHECKPOINT_DIR

model = str(CHECKPOINT_DIR)
eager = exact_assembly(model, max_num_seqs=1).engine
compiled = exact_assembly(model, max_num_seqs=1, compile_decode=True).engine
prompts = _prompts(eager.model_config.vocab_size, 8, 32, 0)
started = time.perf_counter()
run_engine(compiled, prompts[:2], 48)
compile_s = time.perf_counter() - started
runs: dict[str, list[float]] = {"engine": [], "engine_compiled": []}
tokens = {}
for repeat in range(3):
    for side in ("engine", "engine_compiled") if repeat % 2 == 0 else ("engine_compiled", "engine"):
        rate, tokens[side] = run_engine(eager if side == "engine" else compiled, prompts, 48)
        runs[side].append(rate)
medians = {k: statistics.median(v) for k, v in runs.items()}
result = {
    "device": str(eager.expert_store.device),
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "",
    "torch": torch.__version__,
    "compile_and_warmup_s": compile_s,
    "tokens_per_s": medians,
    "all_runs": runs,
    "compiled_over_eager": medians["engine_compiled"] / medians["engine"],
    "tokens_equal": tokens["engine"] == tokens["engine_compiled"],
    "compiled_forwards": compiled.runner.compiled.num_forwards,
}
print(json.dumps(result, indent=1))
json.dump(result, open(sys.argv[1], "w"), indent=1)
