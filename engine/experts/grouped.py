"""The one experts kernel: transformers' ``grouped_mm`` experts forward over a stack of expert slots.

Every routed expert the engine computes — resident, just loaded, on the CPU from its host copy, or a
dequantized low-bit copy — and every expert an exact or replay baseline computes goes through
:func:`grouped_rows`: rows sorted by slot (stably), one grouped matmul per projection, the module's own
gate, the routing weight applied per (token, top-k) row. :func:`sum_rows` then reduces each token's top-k
rows exactly as transformers does (reshape + sum). A slot's rows are computed by the same per-group
matmul whatever other slots the call holds, so an expert's output does not depend on where it sits.

On a CPU, when the caller has the rows' slots on the host (the dispatch's one routing copy) and they fall in
few groups (a decode step), the rows are sorted on the host and each non-empty group gets its own matmul:
exactly the per-group matmul of transformers' ``grouped_mm`` on a CPU (bitwise, tests/test_dispatch.py),
without its walk over every empty group and the device-side sort.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from transformers.integrations.moe import _grouped_linear

from fallbackgate.engine.experts.weights import ExpertWeights

MAX_STACK_BYTES = 128 * 1024 * 1024  # experts a baseline stacks at once (a layer of a real model is GBs)
MAX_HOST_GROUPS = 8  # on a CPU, at most this many non-empty groups are computed one matmul each
MAX_HOST_ROWS = 64  # ... in a call of at most this many rows


def grouped_rows(
    module: torch.nn.Module,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    hidden: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    top_k: int,
    host_slots: np.ndarray | None = None,
    base: int = 0,
) -> torch.Tensor:
    """Weighted expert output per (token, top-k) row, ``[T * k, H]``.

    `gate_up` ``[S, 2I, H]`` and `down` ``[S, H, I]`` are the slot stacks, `slots` ``[T * k]`` the slot of
    each row (-1: not computed here, its row is zero), `weights` ``[T * k]`` the routing weights;
    `host_slots`, when given, is `slots` on the host; `base` is the slot the stacks start at (`slots` count
    from the start of a larger pool).
    """
    num_slots = gate_up.shape[0]
    if host_slots is not None and hidden.device.type == "cpu" and len(host_slots) <= MAX_HOST_ROWS:
        groups = _host_groups([slot - base if slot >= 0 else -1 for slot in host_slots.tolist()])
        if groups is not None:
            return _host_grouped_rows(module, gate_up, down, hidden, weights, top_k, *groups)
    if base:
        slots = torch.where(slots >= 0, slots - base, slots)
    keys = torch.where(slots >= 0, slots, num_slots)  # rows computed elsewhere sort to the tail, past every group
    keys_g, perm = torch.sort(keys, stable=True)
    x = hidden[perm // top_k]
    offsets = torch.cumsum(torch.bincount(keys_g, minlength=num_slots + 1)[:num_slots], dim=0, dtype=torch.int32)
    proj = _grouped_linear(x, gate_up, offsets)
    proj = module._apply_gate(proj)
    proj = _grouped_linear(proj, down, offsets)
    proj = proj.masked_fill((keys_g >= num_slots).unsqueeze(-1), 0.0)  # the kernel leaves tail rows unwritten
    if getattr(module, "has_post_expert_norm", False):
        proj = module.post_expert_norm(proj)
    weighted = proj * weights[perm].unsqueeze(-1)
    rows = torch.empty_like(weighted)
    rows[perm] = weighted
    return rows


def _host_groups(slots: list[int]) -> tuple[list[int], list[tuple[int, int, int]]] | None:
    """The computed rows (slot >= 0) in slot order, stably, and each group's (slot, first, stop) in that
    order; None when there are more than MAX_HOST_GROUPS groups."""
    perm = sorted((row for row, slot in enumerate(slots) if slot >= 0), key=slots.__getitem__)
    spans: list[tuple[int, int, int]] = []
    first = 0
    for position in range(1, len(perm) + 1):
        if position == len(perm) or slots[perm[position]] != slots[perm[first]]:
            if len(spans) == MAX_HOST_GROUPS:
                return None
            spans.append((slots[perm[first]], first, position))
            first = position
    return perm, spans


def _host_grouped_rows(
    module: torch.nn.Module,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    hidden: torch.Tensor,
    weights: torch.Tensor,
    top_k: int,
    perm_rows: list[int],
    spans: list[tuple[int, int, int]],
) -> torch.Tensor:
    """:func:`grouped_rows` with the computed rows sorted on the host (`perm_rows`, grouped as `spans`, see
    :func:`_host_groups`): one matmul per non-empty group; rows not computed here stay zero. When every row is
    computed here and each group has one row (a one-token decode), each row's matmuls run on that row in row
    order with one gate call over all rows: no gather or scatter, the same per-row arithmetic."""
    num_rows = weights.shape[0]
    if not perm_rows:
        dtype = torch.promote_types(down.dtype, weights.dtype)
        return torch.zeros((num_rows, down.shape[1]), dtype=dtype, device=hidden.device)
    if len(perm_rows) == num_rows and all(stop - first == 1 for _, first, stop in spans):
        slot_of = {perm_rows[first]: slot for slot, first, _ in spans}
        rows_x = (hidden if hidden.dtype == gate_up.dtype else hidden.to(gate_up.dtype)).split(1)
        order = range(num_rows)
        gated = module._apply_gate(torch.cat([F.linear(rows_x[r // top_k], gate_up[slot_of[r]]) for r in order]))
        gated_rows = (gated if gated.dtype == down.dtype else gated.to(down.dtype)).split(1)
        out = torch.cat([F.linear(gated_rows[r], down[slot_of[r]]) for r in order])
        if getattr(module, "has_post_expert_norm", False):
            out = module.post_expert_norm(out)
        return out * weights.unsqueeze(-1)
    perm = torch.tensor(perm_rows)
    x = hidden[torch.tensor([row // top_k for row in perm_rows])].to(gate_up.dtype)
    proj = x.new_empty((len(perm_rows), gate_up.shape[1]))
    for slot, first, stop in spans:
        torch.mm(x[first:stop], gate_up[slot].t(), out=proj[first:stop])
    proj = module._apply_gate(proj).to(down.dtype)
    out = proj.new_empty((len(perm_rows), down.shape[1]))
    for slot, first, stop in spans:
        torch.mm(proj[first:stop], down[slot].t(), out=out[first:stop])
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    weighted = out * weights[perm].unsqueeze(-1)
    rows = weighted.new_zeros((num_rows, weighted.shape[1]))
    rows[perm] = weighted
    return rows


def sum_rows(rows: torch.Tensor, num_tokens: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """Each token's top-k rows summed (as transformers' grouped forward reduces them), in `dtype`."""
    summed = rows.view(num_tokens, top_k, rows.shape[-1]).sum(dim=1)
    return summed if summed.dtype == dtype else summed.to(dtype)


def single_expert_rows(
    module: torch.nn.Module, expert: ExpertWeights, x: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """One expert's weighted rows for the tokens `x` (a one-slot stack through the same kernel). On a CPU
    its one group's matmuls run on the rows as they are: the per-group matmul of :func:`grouped_rows` without
    its sort, gather and scatter (bitwise the same rows, tests/test_dispatch.py)."""
    if x.device.type == "cpu" and x.shape[0]:
        proj = torch.mm(x if x.dtype == expert.gate_up.dtype else x.to(expert.gate_up.dtype), expert.gate_up.t())
        proj = module._apply_gate(proj)
        out = torch.mm(proj if proj.dtype == expert.down.dtype else proj.to(expert.down.dtype), expert.down.t())
        if getattr(module, "has_post_expert_norm", False):
            out = module.post_expert_norm(out)
        return out * weights.unsqueeze(-1)
    slots = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    return grouped_rows(module, expert.gate_up[None], expert.down[None], x, slots, weights, 1)


def stacked_forward(
    module: torch.nn.Module,
    load: Callable[[int], ExpertWeights],
    num_experts: int,
    hidden: torch.Tensor,
    slot_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    max_stack_bytes: int = MAX_STACK_BYTES,
) -> torch.Tensor:
    """The experts forward over temporary stacks of a baseline's own copies: `slot_index` ``[T, k]`` names each
    row's expert, ``0 .. num_experts - 1`` (-1: omitted), and ``load(i)`` gives expert ``i``. Experts are loaded
    and stacked in groups of at most `max_stack_bytes` (at least one), each computed over its own rows only, so
    an audit of a layer holds one group and its rows, not the layer and every row each time; a row is computed
    by the same per-slot matmul, over the same rows in the same order, whatever group its expert is in."""
    num_tokens, top_k = slot_index.shape
    if not num_experts:
        return torch.zeros_like(hidden)
    flat, weights = slot_index.reshape(-1), top_k_weights.reshape(-1)
    rows: torch.Tensor | None = None
    first = 0
    while first < num_experts:
        group = [load(first)]
        per_expert = max(1, group[0].gate_up.nbytes + group[0].down.nbytes)
        stop = min(num_experts, first + max(1, max_stack_bytes // per_expert))
        group += [load(i) for i in range(first + 1, stop)]
        gate_up = torch.stack([e.gate_up.to(hidden.device) for e in group])
        down = torch.stack([e.down.to(hidden.device) for e in group])
        del group
        here = torch.nonzero((flat >= first) & (flat < stop)).squeeze(-1)  # the group's rows, in row order
        part = grouped_rows(module, gate_up, down, hidden[here // top_k], flat[here] - first, weights[here], 1)
        del gate_up, down
        if rows is None:
            rows = torch.zeros((flat.numel(), part.shape[-1]), dtype=part.dtype, device=part.device)
        rows[here] = part
        first = stop
    return sum_rows(rows, num_tokens, top_k, hidden.dtype)
