"""Routed experts read one at a time from the checkpoint's own safetensors files: the disk tier.

An expert's matrices are found by name (`sources`), read as stored (`source_read`) and checked against the
checkpoint's manifest (`manifest`).

Block-scaled FP8 checkpoints (DeepSeek-V3, Qwen3-FP8 as published) hold each per-expert matrix as e4m3
codes with a ``….weight_scale_inv`` beside it: the codes and scales stream from disk (about half a bf16
expert's bytes) and stay FP8 (`read_stored`) until the expert is used, then are dequantized as transformers
dequantizes them (`fp8_experts`).

Integrity: every disk read is checked against the manifest's per-expert xxh3-64, so a wrongly mapped tensor or
a changed file is caught, not certified.
"""

from __future__ import annotations

import functools

import torch

from fallbackgate.engine.errors import CheckpointError, ExpertReadError
from fallbackgate.engine.experts import fp8_experts
from fallbackgate.engine.experts.manifest import MANIFEST_FILE, read_manifest, weights_digest
from fallbackgate.engine.experts.quarantine import Quarantine
from fallbackgate.engine.experts.source_read import read_scales, read_source
from fallbackgate.engine.experts.sources import ExpertKey, map_experts
from fallbackgate.engine.experts.weights import BlockScaled, ExpertWeights, HeldWeights
from fallbackgate.engine.model.checkpoint_files import CheckpointFiles


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
