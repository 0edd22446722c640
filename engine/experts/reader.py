"""Routed experts read one at a time from the checkpoint's own safetensors files: the disk tier.

An expert's matrices are found by name, in either layout transformers reads:

- per expert (as checkpoints are published and ``save_pretrained`` writes them):
  ``….layers.L.<mlp>.experts.E.{gate_proj,up_proj,down_proj}.weight`` or Mixtral's ``w1``/``w3``/``w2``;
- fused: ``….layers.L.<mlp>.experts.gate_up_proj`` ``[E, 2I, H]`` and ``….experts.down_proj`` ``[E, H, I]``,
  read one expert's rows with ``get_slice``.

Block-scaled FP8 checkpoints (DeepSeek-V3, Qwen3-FP8 as published) hold each per-expert matrix as e4m3
codes with a ``….weight_scale_inv`` beside it: the codes and scales stream from disk (about half a bf16
expert's bytes) and stay FP8 (`read_stored`) until the expert is used, then are dequantized as transformers
dequantizes them (`fp8_experts`).

Integrity: a manifest (``fallbackgate-manifest.json`` beside the weights) records, per expert, the tensors
it maps to and an xxh3-64 of its bytes (gate_up then down, in the checkpoint's dtype). It is written by
``fallbackgate.synth`` from the tensors it generated, or by ``fallbackgate verify --model DIR``; every disk
read is checked against it, so a wrongly mapped tensor or a changed file is caught, not certified.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re
from collections.abc import Callable

import torch
import xxhash

from fallbackgate.engine.errors import CheckpointError, ExpertReadError
from fallbackgate.engine.experts import fp8_experts
from fallbackgate.engine.experts.quarantine import Quarantine
from fallbackgate.engine.experts.weights import BlockScaled, ExpertWeights, HeldWeights
from fallbackgate.engine.model import fp8
from fallbackgate.engine.model.checkpoint_files import CheckpointFiles

ExpertKey = tuple[int, int]  # (layer, expert_id)
MANIFEST_FILE = "fallbackgate-manifest.json"
MANIFEST_VERSION = 1
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.layers\.(?P<layer>\d+)\..*)\.experts\.(?P<expert>\d+)\."
    r"(?P<role>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_FUSED = re.compile(r"^(?P<prefix>.*\.layers\.(?P<layer>\d+)\..*)\.experts\.(?P<role>gate_up_proj|down_proj)$")
_ROLE = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclasses.dataclass(slots=True, frozen=True)
class ExpertSource:
    """Where one expert's bytes are: (tensor name, row of a fused tensor or None) per part, in byte order."""

    parts: tuple[tuple[str, int | None], ...]  # (gate, up, down) per expert, or (gate_up, down) fused
    scale_parts: tuple[str, ...] = ()  # FP8: each part's weight_scale_inv tensor, in the order of `parts`


def is_expert_tensor(name: str) -> bool:
    """True for a routed expert's tensor (either layout, FP8 scales included); shared experts and routers
    are dense."""
    if fp8.is_scale_tensor(name):
        name = name[: -len(fp8.SCALE_SUFFIX)]
    return bool(_PER_EXPERT.match(name) or _FUSED.match(name))


def map_experts(files: CheckpointFiles) -> dict[ExpertKey, ExpertSource]:
    """Every routed expert of the checkpoint and the tensors that hold it."""
    per_expert: dict[ExpertKey, dict[str, str]] = {}
    fused: dict[int, dict[str, str]] = {}
    for name in files.names():
        if match := _PER_EXPERT.match(name):
            key = (int(match["layer"]), int(match["expert"]))
            per_expert.setdefault(key, {})[_ROLE.get(match["role"], match["role"])] = name
        elif match := _FUSED.match(name):
            fused.setdefault(int(match["layer"]), {})[match["role"]] = name
    sources: dict[ExpertKey, ExpertSource] = {}
    for key, roles in per_expert.items():
        missing = {"gate_proj", "up_proj", "down_proj"} - set(roles)
        if missing:
            raise CheckpointError(f"{files.path}: expert {key} lacks tensor(s) {sorted(missing)} (has {roles})")
        names = [roles[r] for r in ("gate_proj", "up_proj", "down_proj")]
        sources[key] = ExpertSource(tuple((n, None) for n in names), _scale_parts(files, key, names))
    for layer, roles in fused.items():
        if set(roles) != {"gate_up_proj", "down_proj"}:
            raise CheckpointError(f"{files.path}: layer {layer} has fused expert tensors {sorted(roles.values())}")
        num_experts = files.shape(roles["gate_up_proj"])[0]
        if any(fp8.scale_name(name) in files.file_by_tensor for name in roles.values()):
            raise CheckpointError(f"{files.path}: layer {layer}: FP8 scales for fused expert tensors are not supported")
        for expert_id in range(num_experts):
            parts = ((roles["gate_up_proj"], expert_id), (roles["down_proj"], expert_id))
            sources[(layer, expert_id)] = ExpertSource(parts)
    return sources


def _scale_parts(files: CheckpointFiles, key: ExpertKey, names: list[str]) -> tuple[str, ...]:
    scales = [fp8.scale_name(name) for name in names]
    found = [name in files.file_by_tensor for name in scales]
    if any(found) and not all(found):
        missing = [name for name, is_found in zip(scales, found, strict=True) if not is_found]
        raise CheckpointError(f"{files.path}: FP8 expert {key} lacks scale tensor(s) {missing}")
    return tuple(scales) if all(found) else ()


def weights_digest(weights: ExpertWeights, scales: tuple[torch.Tensor, ...] = ()) -> str:
    """xxh3-64 (hex) of an expert's bytes: gate_up then down, in their dtype, then any FP8 scales."""
    digest = xxhash.xxh3_64()
    for tensor in (weights.gate_up, weights.down, *scales):
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


def read_scales(files: CheckpointFiles, source: ExpertSource) -> tuple[torch.Tensor, ...]:
    """An FP8 expert's block scales (gate, up, down), in fresh memory; empty for other checkpoints."""
    raw = files.read_parts([(name, None) for name in source.scale_parts])
    return tuple(
        r.view(files.dtype(name)).view(files.shape(name)) for r, name in zip(raw, source.scale_parts, strict=True)
    )


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


def read_source(files: CheckpointFiles, source: ExpertSource) -> ExpertWeights:
    """One expert's matrices as stored ([2I, H] and [H, I]), unverified, in fresh memory this process owns
    (read with pread, never a view of a file mapping that a later in-place write could change). Separate
    gate and up tensors become one [2I, H] tensor without keeping a second copy: a view when up follows gate
    in the read buffer; Mixtral's w1, w2, w3 (gate, down, up, back to back) are reordered in the buffer to
    gate, up, down and viewed; otherwise gate and up are concatenated and down copied out, so the read
    buffer is released (the expert's bytes are held once)."""
    shapes = [files.shape(name)[1:] if index is not None else files.shape(name) for name, index in source.parts]
    dtype = files.dtype(source.parts[0][0])
    raw = files.read_parts(list(source.parts))
    if len(source.parts) == 2:
        return ExpertWeights(raw[0].view(dtype).view(shapes[0]), raw[1].view(dtype).view(shapes[1]))
    gate, up, down = raw
    rows = (shapes[0][0] + shapes[1][0], *shapes[0][1:])
    if _follows(gate, up):
        gate_up = gate.as_strided((gate.numel() + up.numel(),), (1,))  # up follows gate in the same buffer
    elif _follows(gate, down) and _follows(down, up):
        gate_up, down = _swap_down_and_up(gate, down, up)
    else:
        gate_up = torch.cat([gate, up])
        down = down.clone() if _shares_storage(down, gate) or _shares_storage(down, up) else down
    return ExpertWeights(gate_up.view(dtype).view(rows), down.view(dtype).view(shapes[-1]))


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _follows(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether flat `second` starts where flat `first` ends, in the same buffer."""
    return _shares_storage(first, second) and first.storage_offset() + first.numel() == second.storage_offset()


def _swap_down_and_up(gate: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder a buffer holding gate, down, up (flat uint8 views, back to back) to gate, up, down in place;
    returns the gate_up and down views. A temporary of up's bytes (of down and up's when their sizes
    differ) lives only during the swap."""
    start, num_down, num_up = down.storage_offset(), down.numel(), up.numel()
    tail = gate.as_strided((num_down + num_up,), (1,), start)  # down then up
    if num_down == num_up:
        saved_up = up.clone()
        tail[num_up:].copy_(tail[:num_down])  # down into up's place: the two ranges do not overlap
        tail[:num_up].copy_(saved_up)
    else:
        saved = tail.clone()
        tail[:num_up].copy_(saved[num_down:])
        tail[num_up:].copy_(saved[:num_down])
    gate_up = gate.as_strided((gate.numel() + num_up,), (1,))
    return gate_up, gate.as_strided((num_down,), (1,), start + num_up)


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


class ExpertReader:
    """Reads one expert at a time from the checkpoint files and checks it against the manifest."""

    def __init__(self, files: CheckpointFiles, compute_dtype: torch.dtype) -> None:
        self.files, self.compute_dtype = files, compute_dtype
        self.sources = map_experts(files)
        manifest = read_manifest(files.path)
        self.digests: dict[ExpertKey, str] = {}
        for key, source in self.sources.items():
            if key not in manifest:
                raise CheckpointError(f"{files.path / MANIFEST_FILE}: no entry for expert {key}; rerun verify")
            listed, digest = manifest[key]
            if listed != source:
                raise CheckpointError(
                    f"{files.path / MANIFEST_FILE}: expert {key} maps to {listed.parts} there, {source.parts} here"
                )
            self.digests[key] = digest
        self.is_checksum_verified = True  # tests turn this off to plant a fault
        self.quarantine = Quarantine()  # experts whose reads failed twice (serving, read-ahead and audits)
        self.is_block_scaled = any(source.scale_parts for source in self.sources.values())  # an FP8 checkpoint
        self.compute_digests: dict[ExpertKey, str] = {}  # FP8: digest of the dequantized weights a verified read gave

    def tensor_files(self, key: ExpertKey) -> dict[str, str]:
        """Each tensor expert `key` is read from (FP8 scales included) and the file that holds it."""
        source = self.sources[key]
        names = [name for name, _ in source.parts] + list(source.scale_parts)
        return {name: str(self.files.file_of(name)) for name in names}

    def read_raw(self, key: ExpertKey) -> ExpertWeights:
        """The expert's matrices in the checkpoint's dtype, unverified ([2I, H] and [H, I])."""
        return read_source(self.files, self.sources[key])

    def read(self, key: ExpertKey) -> ExpertWeights:
        """Read, verify against the manifest, and cast (FP8: dequantize) to the compute dtype."""
        held = self.read_stored(key)
        if isinstance(held, ExpertWeights):
            return held
        weights = fp8_experts.to_compute(held, self.compute_dtype)
        self.compute_digests[key] = weights_digest(weights)
        return weights

    def read_stored(self, key: ExpertKey) -> HeldWeights:
        """Read and verify against the manifest; FP8 stays codes and scales as stored (`BlockScaled`),
        anything else is cast to the compute dtype."""
        weights, source = self.read_raw(key), self.sources[key]
        scales = read_scales(self.files, source)
        found = weights_digest(weights, scales) if self.is_checksum_verified else self.digests[key]
        if found != self.digests[key]:
            names = ", ".join(name for name, _ in source.parts)
            raise ExpertReadError(
                f"expert {key}: bytes of {names} do not match the manifest's xxh3-64 "
                f"(expected {self.digests[key]}, read {found})",
                self.digests[key],
                found,
            )
        if scales:
            return BlockScaled(weights.gate_up, weights.down, scales)
        if weights.gate_up.dtype != self.compute_dtype:
            return ExpertWeights(weights.gate_up.to(self.compute_dtype), weights.down.to(self.compute_dtype))
        return weights

    def compute_digest(self, key: ExpertKey) -> str:
        """FP8: the digest a correct copy of expert `key` in the compute dtype has (read once if unknown)."""
        if key not in self.compute_digests:
            self.read(key)
        return self.compute_digests[key]

    @property
    def num_params_per_expert(self) -> int:
        """Parameters of one expert (all experts of a checkpoint have the same shapes)."""
        key = next(iter(self.sources))
        return sum(_num_elements(self.files, name, index) for name, index in self.sources[key].parts)

    @property
    def checkpoint_bytes_per_expert(self) -> int:
        """Bytes one expert occupies in the checkpoint files (FP8: codes and scales)."""
        key = next(iter(self.sources))
        scale_bytes = sum(
            _num_elements(self.files, n, None) * self.files.element_size(n) for n in self.sources[key].scale_parts
        )
        return self.num_params_per_expert * self.files.element_size(self.sources[key].parts[0][0]) + scale_bytes

    @functools.cached_property
    def matrix_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Shapes of one expert's two matrices as computed with: [2I, H] gate_up and [H, I] down (all experts
        of a checkpoint share them)."""
        key = next(iter(self.sources))
        shapes = [self.files.shape(n)[1:] if i is not None else self.files.shape(n) for n, i in self.sources[key].parts]
        matrices = [(shapes[0][0] + shapes[1][0], shapes[0][1]), shapes[2]] if len(shapes) == 3 else shapes
        (gate_up_rows, gate_up_cols), (down_rows, down_cols) = matrices
        return (gate_up_rows, gate_up_cols), (down_rows, down_cols)

    def max_rows_numel(self, num_rows: int) -> int:
        """Elements in `num_rows` rows (or all rows, when fewer) of the larger of one expert's two
        matrices ([2I, H] gate_up and [H, I] down)."""
        return max(min(num_rows, rows) * cols for rows, cols in self.matrix_shapes)

    @property
    def compute_bytes_per_expert(self) -> int:
        """Bytes one expert occupies in memory, in the compute dtype."""
        return self.num_params_per_expert * self.compute_dtype.itemsize

    @property
    def held_bytes_per_expert(self) -> int:
        """Bytes of one host copy as `read_stored` returns it: FP8 codes and scales as stored, else the
        compute dtype."""
        return self.checkpoint_bytes_per_expert if self.is_block_scaled else self.compute_bytes_per_expert

    @functools.cached_property
    def dequant_scratch_bytes(self) -> int:
        """FP8: peak bytes of one expert's dequantization into a slot (`fp8_experts.scratch_bytes`); else 0."""
        if not self.is_block_scaled:
            return 0
        key = next(iter(self.sources))
        block_rows = max(
            self.files.shape(name)[0] // self.files.shape(scales)[0]
            for (name, _), scales in zip(self.sources[key].parts, self.sources[key].scale_parts, strict=True)
        )
        return fp8_experts.scratch_bytes(self.matrix_shapes, block_rows, self.compute_dtype)


def _num_elements(files: CheckpointFiles, name: str, index: int | None) -> int:
    shape = files.shape(name)[1:] if index is not None else files.shape(name)
    size = 1
    for dim in shape:
        size *= dim
    return size
