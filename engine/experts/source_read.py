"""One expert's bytes read from the checkpoint files as stored, unverified: its matrices (separate gate and
up tensors joined into one gate_up without a second copy) and, for FP8 checkpoints, its block scales."""

from __future__ import annotations

import torch

from fallbackgate.engine.experts.sources import ExpertSource
from fallbackgate.engine.experts.weights import ExpertWeights
from fallbackgate.engine.model.checkpoint_files import CheckpointFiles


def read_scales(files: CheckpointFiles, source: ExpertSource) -> tuple[torch.Tensor, ...]:
    """An FP8 expert's block scales (gate, up, down), in fresh memory; empty for other checkpoints."""
    raw = files.read_parts([(name, None) for name in source.scale_parts])
    return tuple(
        r.view(files.dtype(name)).view(files.shape(name)) for r, name in zip(raw, source.scale_parts, strict=True)
    )


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
