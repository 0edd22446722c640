"""python -m fallbackgate.synth --like olmoe-1b-7b [--num-layers N] [--dtype bf16] --out DIR

Writes a random-weight checkpoint with a published model's shapes (config.json, safetensors shards with
an index, the expert manifest, the bundled tokenizer), shard by shard. The bundled tokenizer's vocabulary
replaces the published one unless --keep-vocab. A name ending in ``-fp8`` (e.g. qwen3-30b-a3b-fp8) stores
linear weights block-scaled FP8 as DeepSeek-V3 and Qwen3-FP8 ship them (--dtype is then the compute dtype).
Exit 2 on bad input (unknown name, not enough disk).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from tqdm import tqdm

from fallbackgate.synth.shapes import ALL_NAMES, resolve
from fallbackgate.synth.writer import DTYPES, SynthError, build_config, check_disk, write_checkpoint
from fallbackgate.tinymoe import CHECKPOINT_DIR


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.synth", description=__doc__.splitlines()[2])
    p.add_argument("--like", required=True, help=f"published shapes: {', '.join(ALL_NAMES)}")
    p.add_argument("--out", required=True, type=pathlib.Path, help="directory to write (created)")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first N decoder layers")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--keep-vocab", action="store_true", help="the published vocabulary size, not the bundled one")
    p.add_argument("--shard-gb", type=float, default=2.0, help="shard size in GB (default 2)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _check(args: argparse.Namespace) -> None:
    if resolve(args.like) is None:
        raise SynthError(f"--like {args.like!r}: unknown; choose one of {', '.join(ALL_NAMES)}")
    if args.dtype not in DTYPES:
        raise SynthError(f"--dtype {args.dtype!r}: choose bf16, fp16 or fp32")
    if args.num_layers is not None and args.num_layers < 1:
        raise SynthError(f"--num-layers {args.num_layers}: must be >= 1")
    if args.shard_gb <= 0:
        raise SynthError(f"--shard-gb {args.shard_gb}: must be > 0")
    if args.out.exists() and any(args.out.iterdir()):
        raise SynthError(f"--out {args.out}: exists and is not empty")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        _check(args)
        resolved = resolve(args.like)
        assert resolved is not None
        model_type, fields, fp8_block = resolved
        bundled = None if args.keep_vocab else json.loads((CHECKPOINT_DIR / "config.json").read_text())
        config = build_config(model_type, fields, args.num_layers, bundled)
        dtype = DTYPES[args.dtype]
        need = check_disk(config, dtype, args.out, fp8_block)
        with tqdm(total=need, unit="B", unit_scale=True, desc=f"synth {args.like}") as bar:
            written = write_checkpoint(
                config, args.out, dtype, CHECKPOINT_DIR, int(args.shard_gb * 1e9), args.seed, bar.update, fp8_block
            )
    except SynthError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {written / 1e9:.2f} GB ({args.like}, {config.num_hidden_layers} layers, {args.dtype}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
