"""python fallbackgate/bench/results/lowbit-fastpath-2026-12-06/dequant_bench.py: stop 50's dequantization of a
low-bit expert (64-row chunks through the general path) against stop 51's, on the bundled model's shapes."""

import time

import torch

from fallbackgate.engine.experts.lowbit_copies import dequantized
from fallbackgate.engine.experts.quant import _dequantize_padded_rows, quantize

PARTS = [quantize(torch.randn(256, 192), 8, axis=1), quantize(torch.randn(192, 128), 8, axis=1)]


def per_call_us(fn, num_calls: int = 2000) -> float:
    for _ in range(100):
        fn()
    started = time.perf_counter()
    for _ in range(num_calls):
        fn()
    return (time.perf_counter() - started) / num_calls * 1e6


for _ in range(3):
    old = per_call_us(lambda: [_dequantize_padded_rows(q, torch.float32, 64) for q in PARTS])
    new = per_call_us(lambda: [dequantized(q, torch.device("cpu"), torch.float32) for q in PARTS])
    print(f"torch threads {torch.get_num_threads()}: stop 50 {old:.0f} us, stop 51 {new:.0f} us an expert")
