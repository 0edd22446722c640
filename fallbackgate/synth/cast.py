"""python -m fallbackgate.synth.cast --model SRC --dtype bf16 --out DST

Writes a copy of a checkpoint with every floating-point tensor cast to another dtype (round to nearest, as
``Tensor.to`` does), shard by shard under the same file names, the index's sizes rewritten, ``config.json``'s
dtype set, every other file copied and the expert manifest rebuilt for the new bytes. Model-side compression
of the simplest kind: the bundled model is fp32, so its bf16 copy stores experts and KV in half the bytes
(``fallbackgate sweep --model DST --ram-basis-from`` the original's sweep compares them at the same RAM).
Block-scaled FP8 checkpoints are refused (their codes and scales are not floats to round). Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from fallbackgate.engine.errors import CheckpointError
from fallbackgate.engine.experts.manifest import MANIFEST_FILE, build_manifest
from fallbackgate.engine.model.checkpoint_files import INDEX_FILE
from fallbackgate.synth.writer import DTYPES, SynthError

CONFIG_DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers 5 writes "dtype", 4.x "torch_dtype"
CASTABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)  # float8 codes need their scales


def cast_tensors(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every floating-point tensor in `dtype`; integer and bool tensors as they are (SynthError for a float8
    tensor, or for a finite value the new dtype cannot hold, e.g. above 65504 in fp16)."""
    out = {}
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.dtype not in CASTABLE:
            raise SynthError(f"tensor {name}: {tensor.dtype} is not cast (its scales would be lost)")
        if not tensor.is_floating_point():
            out[name] = tensor.contiguous()
            continue
        cast = tensor.to(dtype).contiguous()
        if not bool(torch.isfinite(cast[torch.isfinite(tensor)]).all()):
            raise SynthError(f"tensor {name}: values beyond {dtype}'s range")
        out[name] = cast
    return out


def cast_checkpoint(
    src: pathlib.Path, dst: pathlib.Path, dtype: torch.dtype, on_file: Callable[[], None] | None = None
) -> int:
    """Write `src` cast to `dtype` into the new directory `dst` (whole or not at all: written beside it, then
    renamed); returns the bytes of weights written."""
    config = _read_config(src)
    if config.get("quantization_config"):
        raise SynthError(f"--model {src}: quantized ({config['quantization_config'].get('quant_method')}); "
                         "only floating-point checkpoints are cast")  # fmt: skip
    weights = weight_files(src)
    staging = dst.with_name(dst.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        sizes: dict[str, int] = {}
        for file in weights:
            cast = cast_tensors(load_file(file), dtype)
            save_file(cast, staging / file.name, metadata={"format": "pt"})
            sizes.update({k: v.numel() * v.element_size() for k, v in cast.items()})
            if on_file is not None:
                on_file()
        _copy_the_rest(src, staging, {f.name for f in weights})
        (staging / "config.json").write_text(json.dumps(_with_dtype(config, dtype), indent=2) + "\n")
        if (src / INDEX_FILE).is_file():
            index = json.loads((src / INDEX_FILE).read_text())
            index.setdefault("metadata", {})["total_size"] = sum(sizes.values())
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        build_manifest(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if dst.exists():
        dst.rmdir()  # main() refuses a non-empty one
    staging.rename(dst)
    return sum(sizes.values())


def weight_files(src: pathlib.Path) -> list[pathlib.Path]:
    """The weight files: those the index names, else every ``*.safetensors``."""
    if (src / INDEX_FILE).is_file():
        names = set(json.loads((src / INDEX_FILE).read_text()).get("weight_map", {}).values())
        files = [src / n for n in sorted(names)]
    else:
        files = sorted(src.glob("*.safetensors"))
    if not files:
        raise SynthError(f"--model {src}: no *.safetensors files")
    return files


def _copy_the_rest(src: pathlib.Path, dst: pathlib.Path, weights: set[str]) -> None:
    """Every other file and folder (tokenizer, cards), but not the weights, config or manifest rewritten here."""
    for item in src.iterdir():
        if item.name in weights or item.name in ("config.json", MANIFEST_FILE, INDEX_FILE):
            continue
        if item.is_dir():
            shutil.copytree(item, dst / item.name)
        elif item.suffix != ".safetensors":
            shutil.copy2(item, dst / item.name)


def _with_dtype(config: dict, dtype: torch.dtype, is_top: bool = True) -> dict:
    """`config` naming `dtype` (``dtype`` at the top always), nested sub-configs (e.g. ``text_config``) too
    where they name one."""
    name = str(dtype).removeprefix("torch.")
    out = {k: _with_dtype(v, dtype, False) if isinstance(v, dict) and k.endswith("_config") else v
           for k, v in config.items()}  # fmt: skip
    for key in CONFIG_DTYPE_KEYS:
        if key in out or (is_top and key == CONFIG_DTYPE_KEYS[0]):
            out[key] = name
    return out


def _read_config(src: pathlib.Path) -> dict:
    try:
        return json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SynthError(f"--model {src}: no readable config.json ({exc})") from None


def main(argv: list[str] | None = None) -> int:
    """Entry point: exit 0 with the copy written, 2 on bad input (nothing left behind)."""
    p = argparse.ArgumentParser(prog="python -m fallbackgate.synth.cast", description=__doc__.splitlines()[2])
    p.add_argument("--model", required=True, type=pathlib.Path, help="checkpoint directory to copy")
    p.add_argument("--dtype", required=True, help="bf16, fp16 or fp32")
    p.add_argument("--out", required=True, type=pathlib.Path, help="directory to write (created)")
    args = p.parse_args(argv)
    try:
        if args.dtype not in DTYPES:
            raise SynthError(f"--dtype {args.dtype!r}: choose bf16, fp16 or fp32")
        if args.out.exists() and any(args.out.iterdir()):
            raise SynthError(f"--out {args.out}: exists and is not empty")
        with tqdm(total=len(weight_files(args.model)), unit="file", desc="cast") as bar:
            written = cast_checkpoint(args.model, args.out, DTYPES[args.dtype], lambda: bar.update(1))
    except (SynthError, CheckpointError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {written / 1e6:.1f} MB of weights ({args.dtype}) and the manifest to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
