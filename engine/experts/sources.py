"""Which checkpoint tensors hold each routed expert, in either layout transformers reads:

- per expert (as checkpoints are published and ``save_pretrained`` writes them):
  ``….layers.L.<mlp>.experts.E.{gate_proj,up_proj,down_proj}.weight`` or Mixtral's ``w1``/``w3``/``w2``;
- fused: ``….layers.L.<mlp>.experts.gate_up_proj`` ``[E, 2I, H]`` and ``….experts.down_proj`` ``[E, H, I]``,
  read one expert's rows with ``get_slice``.

A block-scaled FP8 checkpoint holds each per-expert matrix with a ``….weight_scale_inv`` beside it; those scale
tensors are part of the expert's source.
"""

from __future__ import annotations

import dataclasses
import re

from fallbackgate.engine.errors import CheckpointError
from fallbackgate.engine.model import fp8
from fallbackgate.engine.model.checkpoint_files import CheckpointFiles

ExpertKey = tuple[int, int]  # (layer, expert_id)
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
