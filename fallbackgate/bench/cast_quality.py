"""python -m fallbackgate.bench.cast_quality --compressed DIR [--model DIR] [--windows 32] [--seq 256] [--json FILE]

What a model's compressed copy (``python -m fallbackgate.synth.cast``) costs in quality before any fallback:
both checkpoints in their own dtype (transformers, no engine), teacher-forced on windows of the held-out
evaluation passages (``evals/data/rolling_ppl.jsonl``). Reports the per-position KL(original ‖ copy) of the
next-token distributions (mean, p99, max), top-1 agreement, each model's perplexity on the windows, and per
MoE layer the share of tokens whose top-k experts are the same set in both (the routing the engine's traces and
controllers see). The engine's audit measures every fallback against the copy's own exact baseline; this is
the copy against the original.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fallbackgate.bench import write_results
from fallbackgate.tinymoe import CHECKPOINT_DIR
from fallbackgate.tinymoe.evaluate import DATA_DIR, read_jsonl, routing_windows
from fallbackgate.tinymoe.metrics import expert_choices


def load(path: pathlib.Path) -> torch.nn.Module:
    """A checkpoint in the dtype its config names."""
    config = json.loads((path / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()


@torch.no_grad()
def compare(original: torch.nn.Module, copy: torch.nn.Module, windows: torch.Tensor) -> dict[str, Any]:
    """KL, top-1 agreement, perplexities and per-layer routing agreement of `copy` against `original`."""
    logp = [torch.log_softmax(m(input_ids=windows).logits.float(), dim=-1) for m in (original, copy)]
    kl = (logp[0].exp() * (logp[0] - logp[1])).sum(-1).flatten().numpy()
    targets = windows[:, 1:]
    nll = [-lp[:, :-1].gather(-1, targets.unsqueeze(-1)).mean().item() for lp in logp]
    routing = [float((a == b).all(-1).mean()) for a, b in zip(*(expert_choices(m, windows) for m in (original, copy)),
                                                               strict=True)]  # fmt: skip
    return {
        "num_tokens": int(windows.numel()),
        "kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)), "kl_max": float(kl.max()),
        "top1_agreement": float((logp[0].argmax(-1) == logp[1].argmax(-1)).float().mean()),
        "perplexity_original": math.exp(nll[0]), "perplexity_copy": math.exp(nll[1]),
        "same_experts_share_per_layer": routing,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Load both checkpoints, compare them on the held-out windows, print and (``--json``) write the result."""
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.cast_quality", description=__doc__.split("\n\n")[1])
    p.add_argument("--model", type=pathlib.Path, default=CHECKPOINT_DIR, help="the original (default: bundled)")
    p.add_argument("--compressed", type=pathlib.Path, required=True, help="its copy (synth.cast --out)")
    p.add_argument("--data", type=pathlib.Path, default=DATA_DIR)
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.windows < 1 or args.seq < 2:
        sys.exit("cast_quality: --windows must be >= 1 and --seq >= 2")
    try:
        original, copy = load(args.model), load(args.compressed)
        texts = [r["text"] for r in read_jsonl(args.data / "rolling_ppl.jsonl")]
    except (OSError, ValueError, AttributeError) as exc:
        sys.exit(f"cast_quality: {exc}")
    windows = routing_windows(AutoTokenizer.from_pretrained(args.model), texts, args.windows, args.seq)
    if windows.shape[0] < args.windows:
        sys.exit(f"cast_quality: the data holds {windows.shape[0]} windows of {args.seq} tokens, not {args.windows}")
    result = compare(original, copy, windows)
    layers = ", ".join(f"{x:.3f}" for x in result["same_experts_share_per_layer"])
    print(f"{result['num_tokens']} tokens: KL(original || copy) mean {result['kl_mean']:.2e}, "
          f"p99 {result['kl_p99']:.2e}, max {result['kl_max']:.2e}; top-1 agreement {result['top1_agreement']:.4f}; "
          f"perplexity {result['perplexity_original']:.2f} -> {result['perplexity_copy']:.2f}; "
          f"same top-k experts per MoE layer {layers}")  # fmt: skip
    if args.json:
        write_results(args.json, model=str(args.model), compressed=str(args.compressed), **result)


if __name__ == "__main__":
    main()
