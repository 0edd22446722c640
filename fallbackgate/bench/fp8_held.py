"""FP8-held experts: host bytes per expert held as codes + scales against dequantized, and the per-use cost
of filling a compute-dtype slot (dequantize block row by block row) against copying a dequantized copy.

``python -m fallbackgate.bench.fp8_held [--like qwen3-30b-a3b] [--repeats 20] [--json FILE]``: one expert
of the named published shape (full width, random weights, 128 × 128 blocks), bf16 compute, on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from fallbackgate.engine.experts import fp8_experts
from fallbackgate.engine.experts.weights import BlockScaled, ExpertWeights
from fallbackgate.engine.model import fp8
from fallbackgate.synth.shapes import FP8_BLOCK, PUBLISHED


def _expert(like: str) -> tuple[BlockScaled, ExpertWeights]:
    """One FP8 expert of `like`'s shape and its dequantized bf16 copy."""
    fields = PUBLISHED[like][1]
    hidden = fields["hidden_size"]
    inter = fields.get("moe_intermediate_size", fields["intermediate_size"])
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(r, c, generator=gen) * 0.02 for r, c in ((inter, hidden), (inter, hidden), (hidden, inter))]
    coded = [fp8.quantize_blocks(p, FP8_BLOCK) for p in parts]
    held = BlockScaled(torch.cat([coded[0][0], coded[1][0]]), coded[2][0], tuple(s for _, s in coded))
    return held, fp8_experts.to_compute(held, torch.bfloat16)


def _median_s(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(like: str, repeats: int) -> dict[str, float | int | str]:
    """Bytes and median per-use times (interleaved) for one expert of `like`."""
    held, dequantized = _expert(like)
    slot = ExpertWeights(torch.empty_like(dequantized.gate_up), torch.empty_like(dequantized.down))
    dequant_s, copy_s = [], []
    for _ in range(repeats):  # interleaved A/B
        dequant_s.append(_median_s(lambda: fp8_experts.write_into(slot, held), 1))
        copy_s.append(_median_s(lambda: fp8_experts.write_into(slot, dequantized), 1))
    assert torch.equal(slot.gate_up, dequantized.gate_up)
    scratch = fp8_experts.scratch_bytes(((held.gate_up.shape[0], held.gate_up.shape[1]), tuple(held.down.shape)),
                                        FP8_BLOCK[0], torch.bfloat16)  # fmt: skip
    return {
        "like": like,
        "held_bytes_fp8": held.num_bytes,
        "held_bytes_bf16": dequantized.num_bytes,
        "held_ratio": held.num_bytes / dequantized.num_bytes,
        "dequant_scratch_bytes": scratch,
        "fill_slot_fp8_ms": 1e3 * statistics.median(dequant_s),
        "fill_slot_bf16_copy_ms": 1e3 * statistics.median(copy_s),
        "load_average_1m": os.getloadavg()[0],
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    """Print (and optionally write) the measurement."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", default="qwen3-30b-a3b", choices=sorted(PUBLISHED))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = measure(args.like, args.repeats)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
