# python fallbackgate/bench/results/trace-overhead-2026-12-07b/speed-swings.py — this VM's own speed over time: one
# bare torch.mm timed for 16 half-second windows, nothing else running (why single trace-cost pairs spread ±12 %).
import statistics
import time

import torch

a, b = torch.randn(512, 2048), torch.randn(2048, 768)
for window in range(16):
    times = []
    started = time.perf_counter()
    while time.perf_counter() - started < 0.5:
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    print(f"chunk {window}: med {statistics.median(times) * 1e3:.3f} ms n {len(times)}")
