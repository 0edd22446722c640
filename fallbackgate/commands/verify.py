"""``fallbackgate verify --model DIR``: map every routed expert to its tensors and write the checksum manifest.

Reads each expert once from the checkpoint's safetensors files (per-expert or fused tensors, sharded or
not), hashes its bytes with xxh3-64 and writes ``fallbackgate-manifest.json`` beside the weights; serving
checks every disk read against it. With ``--check``, compares the files with an existing manifest
instead and exits 1 on any difference. Exit 2 for a bad checkpoint (the message names file and tensor).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

from tqdm.auto import tqdm

from fallbackgate.engine.errors import CheckpointError
from fallbackgate.engine.experts.manifest import build_manifest, read_manifest, source_digest
from fallbackgate.engine.experts.sources import map_experts
from fallbackgate.engine.model.checkpoint_files import CheckpointFiles


def add_parser(subparsers: Any) -> None:
    """Register ``verify``."""
    p: argparse.ArgumentParser = subparsers.add_parser("verify", help="write (or --check) a checkpoint's manifest")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--check", action="store_true", help="compare the files with the existing manifest")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate verify``."""
    path = pathlib.Path(args.model)
    try:
        if not (path / "config.json").is_file():
            raise CheckpointError(f"--model {path}: no config.json there")
        if args.check:
            return _check(path, args.quiet)
        files = CheckpointFiles(path)
        with tqdm(total=len(map_experts(files)), unit="expert", disable=args.quiet, desc="verify") as bar:
            num = build_manifest(path, lambda: bar.update(1))
    except (CheckpointError, OSError) as exc:
        print(f"fallbackgate verify: error: {exc}", file=sys.stderr)
        return 2
    print(f"{path}: {num} experts mapped and hashed (xxh3-64); manifest written")
    return 0


def _check(path: pathlib.Path, is_quiet: bool) -> int:
    files, manifest = CheckpointFiles(path), read_manifest(path)
    sources, bad = map_experts(files), []
    for key in tqdm(sorted(sources), unit="expert", disable=is_quiet, desc="check"):
        listed = manifest.get(key)
        if listed is None or listed[0] != sources[key]:
            bad.append(f"expert {key}: not in the manifest as mapped here")
        elif source_digest(files, sources[key]) != listed[1]:
            bad.append(f"expert {key}: {', '.join(n for n, _ in sources[key].parts)} differ from the manifest")
    bad += [f"expert {key}: in the manifest, not in the files" for key in sorted(set(manifest) - set(sources))]
    for line in bad:
        print(line)
    print(f"{path}: {len(sources) - len(bad)} of {len(sources)} experts match the manifest")
    return 1 if bad else 0
