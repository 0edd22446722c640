"""The checkpoint's integrity manifest (``fallbackgate-manifest.json`` beside the weights): per expert, the
tensors it maps to and an xxh3-64 of its bytes (gate_up then down, in the checkpoint's dtype, then any FP8
scales). It is written by ``fallbackgate.synth`` from the tensors it generated, or by ``fallbackgate verify
--model DIR`` (`build_manifest`); :class:`~fallbackgate.engine.experts.reader.ExpertReader` checks every disk
read against it."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import torch
import xxhash

from fallbackgate.engine.errors import CheckpointError
from fallbackgate.engine.experts.source_read import read_scales, read_source
from fallbackgate.engine.experts.sources import ExpertKey, ExpertSource, map_experts
from fallbackgate.engine.experts.weights import ExpertWeights
from fallbackgate.engine.model.checkpoint_files import CheckpointFiles

MANIFEST_FILE = "fallbackgate-manifest.json"
MANIFEST_VERSION = 1


def weights_digest(weights: ExpertWeights, scales: tuple[torch.Tensor, ...] = ()) -> str:
    """xxh3-64 (hex) of an expert's bytes: gate_up then down, in their dtype, then any FP8 scales."""
    digest = xxhash.xxh3_64()
    for tensor in (weights.gate_up, weights.down, *scales):
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


def source_digest(files: CheckpointFiles, source: ExpertSource) -> str:
    """The manifest's digest of one expert as the files hold it (codes and scales for FP8)."""
    return weights_digest(read_source(files, source), read_scales(files, source))


def _key_text(key: ExpertKey) -> str:
    return f"{key[0]}:{key[1]}"


def write_manifest(path: pathlib.Path, digests: dict[ExpertKey, str], sources: dict[ExpertKey, ExpertSource]) -> None:
    """Write the manifest: per expert its tensors and xxh3-64 digest."""
    experts = {
        _key_text(key): {"parts": [list(p) for p in sources[key].parts], "xxh3_64": digests[key]}
        | ({"scale_parts": list(sources[key].scale_parts)} if sources[key].scale_parts else {})
        for key in sorted(digests)
    }
    body = {"format_version": MANIFEST_VERSION, "hash": "xxh3_64", "experts": experts}
    tmp = path / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(body, indent=0))
    tmp.replace(path / MANIFEST_FILE)


def read_manifest(path: pathlib.Path) -> dict[ExpertKey, tuple[ExpertSource, str]]:
    """The manifest's experts; a clear error when it is missing or malformed."""
    file = path / MANIFEST_FILE
    if not file.exists():
        raise CheckpointError(
            f"{path}: no {MANIFEST_FILE} (per-expert checksums); create it with `fallbackgate verify --model {path}`"
        )
    try:
        body = json.loads(file.read_text())
        if body.get("format_version") != MANIFEST_VERSION or body.get("hash") != "xxh3_64":
            raise ValueError(f"format_version {body.get('format_version')!r}, hash {body.get('hash')!r}")
        out = {}
        for text, entry in body["experts"].items():
            layer, expert = (int(x) for x in text.split(":"))
            parts = tuple((str(n), None if i is None else int(i)) for n, i in entry["parts"])
            scale_parts = tuple(str(n) for n in entry.get("scale_parts", ()))
            out[(layer, expert)] = (ExpertSource(parts, scale_parts), str(entry["xxh3_64"]))
        return out
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{file}: not a fallbackgate manifest: {exc}") from exc


def build_manifest(path: pathlib.Path, on_expert: Callable[[], None] | None = None) -> int:
    """Map every expert of the checkpoint at `path` to its tensors, hash its bytes, write the manifest.

    Returns the number of experts. `on_expert` is called after each one (a progress bar).
    """
    files = CheckpointFiles(path)
    sources = map_experts(files)
    if not sources:
        raise CheckpointError(f"{path}: no routed-expert tensors found (names like ...experts.0.gate_proj.weight)")
    digests = {}
    for key in sorted(sources):
        digests[key] = source_digest(files, sources[key])
        if on_expert is not None:
            on_expert()
    write_manifest(path, digests, sources)
    return len(digests)
