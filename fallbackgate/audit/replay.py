"""The replay baseline: a served request recomputed with its recorded approximate actions repeated exactly.

The exact baseline measures what approximation *cost*; the replay checks that the engine did what its
ledger says. Each audited request is recomputed teacher-forced, forward by forward as it was served
(consecutive steps that read the same KV versions run as one forward), with

- experts read from the checkpoint files through the checksummed reader (never the store's copies);
- the served routing: where the replay's router and the step's recorded routing digest disagree, the
  k-th expert swapped for the next at the tokens nearest a router tie until they agree (``routing_ties``);
- the same experts deferred per step, layer and request, their gate weights renormalised to the old sum;
- the same low-bit copies: the file's weights quantized and dequantized with the engine's codec and bits;
- each query position reading the KV version it really read (``ReplayTrace.read_versions``): blocks a
  step rebuilt are recomputed by a rebuild pass with that pass's own expert actions, and that version is
  read while the block stays on device; a copy read (exactly or dequantized) is the block's version when
  the copy was written, not a later rebuild's; blocks a step read dequantized are quantized from that
  version with the recorded bits, their codes rebuilt to the checksum recorded for the served copy
  (``kv_codes``: a code at a rounding boundary may flip; any other difference fails the request), then
  dequantized; a re-prefill restarts from its start;
- its own attention: per-request SDPA over its own K/V with an explicit causal mask.

Served logits that differ from the replay's beyond the numeric floor are a correctness bug, whatever the
quality budget allows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fallbackgate.audit.kv_codes import served_round_trip
from fallbackgate.audit.replay_trace import ExpertActions, KVActions, ReplayTrace, Segment, TraceError, Versions
from fallbackgate.audit.routing_ties import RoutingError, served_routing
from fallbackgate.engine.baseline.api import (
    BaselineEngine,
    ExpertWeights,
    lowbit_round_trip,
    stacked_forward,
)

MAX_CACHED_EXPERTS = 64  # low-bit round-tripped experts kept between the replay's forwards (bounded memory)


class _ReplayLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, replayer: Replayer, layer: int) -> None:
        super().__init__()
        self.replayer, self.layer, self.is_initialized = replayer, layer, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.replayer.kv_update(self.layer, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.replayer.start + query_length, 0

    def get_seq_length(self) -> int:
        return self.replayer.start

    def get_max_length(self) -> int:
        return -1


class Replayer:
    """Recomputes one request from its :class:`ReplayTrace` on an engine's model (no store is touched)."""

    def __init__(self, engine: BaselineEngine, trace: ReplayTrace) -> None:
        self.engine, self.trace = engine, trace
        self.block_size, self.key_dim = engine.block_size, engine.kv_key_dim
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [1, H, L, Dk] as the positions were written
        self.values: dict[int, torch.Tensor] = {}
        self.versions = trace.read_versions(self.block_size)  # step -> the versions its queries read
        self._kept: dict[tuple[int, int, int], int] = {}  # (layer, block, rebuild step) -> last step reading it
        for step, by_layer in sorted(self.versions.items()):
            for layer, blocks in by_layer.items():
                for block, v in blocks.items():
                    if v.rebuilt_at is not None:
                        self._kept[layer, block, v.rebuilt_at] = step
        self.rebuilt: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # -> [1, H, n, D] K, V
        self.cache = Cache(layers=[_ReplayLayer(self, i) for i in range(engine.num_layers)])
        self._lowbit: OrderedDict[tuple[int, int, int], ExpertWeights] = OrderedDict()  # round-tripped copies
        # the current forward
        self.start = 0
        self.token_steps: list[int] = []
        self.segments: list[Segment] = []  # the current forward's (none for a rebuild pass)
        self.num_routing_swaps = 0  # tokens routed as served across a router near-tie (routing_ties)
        self.is_rebuild = False
        self.kv_actions = KVActions()
        self.kv_versions: Versions = {}  # the current forward's
        self.kv_step = 0  # the step whose KV reads the current forward repeats
        self.num_rows = 0  # output rows produced so far

    # --- driving ---------------------------------------------------------------------------------
    def run(self, max_rows: int = 32) -> Iterator[torch.Tensor]:
        """fp32 logits that produced each output token, as served: [<= max_rows, vocab] chunks in output
        order (the full-vocabulary rows held at once stay bounded)."""
        stretch: list[Segment] = []
        length, self.num_rows = 0, 0
        for seg in self.trace.segments:
            if seg.start > length:
                raise TraceError(
                    f"request {self.trace.request_id}: step {seg.step_id} starts at position {seg.start} but "
                    f"only {length} were computed before it (step rows missing?)"
                )
            is_full = sum(s.is_sampled for s in stretch) >= max_rows
            reads = self.versions.get(seg.step_id, {})
            is_same_reads = bool(stretch) and reads == self.versions.get(stretch[0].step_id, {})
            is_rebuilt = self.trace.is_rebuilt(seg.step_id)
            if seg.start < length or is_rebuilt or is_full or (stretch and not is_same_reads):
                yield from self._forward(stretch)
                stretch = []
                self._crop(seg.start)
            if is_rebuilt:
                self._rebuild(seg)
            stretch.append(seg)
            length = seg.start + seg.num_tokens
        yield from self._forward(stretch)
        if self.num_rows != self.trace.num_output_tokens:
            raise TraceError(
                f"request {self.trace.request_id}: {self.num_rows} sampling steps recorded for "
                f"{self.trace.num_output_tokens} output tokens"
            )

    def _forward(self, segments: list[Segment]) -> Iterator[torch.Tensor]:
        """One forward over consecutive segments; yields the logits of those that sampled (if any)."""
        if not segments:
            return
        self.start, self.is_rebuild = segments[0].start, False
        self.kv_actions = KVActions()  # every segment here reads the same versions, and rebuilds nothing
        self.kv_step = segments[0].step_id
        self.kv_versions = self.versions.get(self.kv_step, {})
        self.token_steps = [s.step_id for s in segments for _ in range(s.num_tokens)]
        self.segments = segments
        keep = [s.start + s.num_tokens - 1 - self.start for s in segments if s.is_sampled]
        for offset, row in enumerate(keep):
            expected = self.trace.num_prompt_tokens - 1 + self.num_rows + offset
            if self.start + row != expected:
                raise TraceError(
                    f"request {self.trace.request_id}: a step sampled at position {self.start + row}, but output "
                    f"token {self.num_rows + offset} was sampled at position {expected}"
                )
        end = segments[-1].start + segments[-1].num_tokens
        tokens = self.trace.token_ids[self.start : end]
        logits = self.engine.replay_forward(self, self.cache, tokens, self.start, keep)
        self.num_rows += len(keep)
        last = segments[-1].step_id  # rebuilt versions no later step reads are let go
        self.rebuilt = {k: kv for k, kv in self.rebuilt.items() if self._kept.get(k, last) > last}
        if keep:
            yield logits[: len(keep)]

    def _rebuild(self, seg: Segment) -> None:
        """The step's KV rebuild pass: positions from its first rebuilt block up to the step's start."""
        rebuilt = self.trace.kv[seg.step_id].rebuilt
        if not rebuilt:
            return
        begin = min(min(blocks) for blocks in rebuilt.values()) * self.block_size
        self.start, self.is_rebuild = begin, True
        self.kv_actions = self.trace.kv[seg.step_id]
        self.kv_step = seg.step_id
        self.kv_versions = self.versions.get(seg.step_id, {})
        self.token_steps = [seg.step_id] * (seg.start - begin)
        self.segments = []
        self.engine.replay_forward(self, self.cache, self.trace.token_ids[begin : seg.start], begin, [])

    def _crop(self, length: int) -> None:
        for layer in self.keys:
            self.keys[layer] = self.keys[layer][:, :, :length]
            self.values[layer] = self.values[layer][:, :, :length]

    # --- the cache --------------------------------------------------------------------------------
    def kv_update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's K/V as the engine's blocks take it; return what its queries read."""
        start, n = self.start, keys.shape[2]
        old_k, old_v = self.keys.get(layer), self.values.get(layer)
        if self.is_rebuild:  # the blocks the step rebuilt take the new K/V as a version of their own
            assert old_k is not None and old_v is not None
            new_k, new_v = old_k, old_v
            for block in self.kv_actions.rebuilt.get(layer, ()):
                if (layer, block, self.kv_step) in self._kept:
                    lo, hi = block * self.block_size, min((block + 1) * self.block_size, start + n)
                    part = (keys[:, :, lo - start : hi - start].clone(), values[:, :, lo - start : hi - start].clone())
                    self.rebuilt[layer, block, self.kv_step] = part
        elif old_k is None or old_v is None:
            new_k, new_v = keys, values
        else:
            new_k, new_v = torch.cat([old_k, keys], dim=2), torch.cat([old_v, values], dim=2)
        self.keys[layer], self.values[layer] = new_k, new_v
        read_k, read_v = new_k[:, :, : start + n], new_v[:, :, : start + n]
        versions = self.kv_versions.get(layer)
        if versions:
            read_k, read_v = read_k.clone(), read_v.clone()
            for block, version in versions.items():
                lo, hi = block * self.block_size, (block + 1) * self.block_size
                if version.rebuilt_at is not None:
                    part_k, part_v = self.rebuilt[layer, block, version.rebuilt_at]
                    read_k[:, :, lo : lo + part_k.shape[2]], read_v[:, :, lo : lo + part_v.shape[2]] = part_k, part_v
                if not version.bits:
                    continue
                packed = torch.cat([read_k[0, :, lo:hi], read_v[0, :, lo:hi]], dim=-1)
                checksum = self.trace.served_checksum(self.kv_step, layer, block, version.bits)
                where = f"request {self.trace.request_id}: step {self.kv_step}, layer {layer}, KV block {block}"
                both = served_round_trip(packed, version.bits, self.key_dim, checksum, where).to(packed.dtype)
                read_k[0, :, lo:hi], read_v[0, :, lo:hi] = both[..., : self.key_dim], both[..., self.key_dim :]
        return read_k, read_v

    # --- hooks the model calls --------------------------------------------------------------------
    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """SDPA of this forward's queries (positions start..) over keys 0..start+n, key ≤ query allowed (MLA
        modules expand their cached latents before calling attention)."""
        n, length = query.shape[2], key.shape[2]
        query_pos = torch.arange(self.start, self.start + n, device=query.device)
        allowed = torch.arange(length, device=query.device)[None, :] <= query_pos[:, None]
        kwargs.pop("is_causal", None)
        out, _ = sdpa_attention_forward(module, query, key, value, allowed[None, None], **kwargs)
        return out

    def experts(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Routed experts with each token's recorded actions: deferred (renormalised), low-bit, else exact;
        routed as served where a router near-tie went the other way (``routing_ties``)."""
        top_k_index = self._served_routing(layer, hidden, top_k_index)
        bits = self._token_bits(layer, top_k_index)  # -1 deferred, 0 exact, else low-bit bits
        weights = top_k_weights
        deferred = bits < 0
        if bool(deferred.any()):
            kept = torch.where(deferred, torch.zeros_like(top_k_weights), top_k_weights)
            old_sum, new_sum = top_k_weights.sum(-1, keepdim=True), kept.sum(-1, keepdim=True)
            scale = torch.where(new_sum > 0, old_sum / new_sum.clamp_min(1e-30), torch.zeros_like(new_sum))
            rows = deferred.any(-1, keepdim=True)
            weights = torch.where(rows, kept * scale, top_k_weights)
        combos = torch.unique(torch.stack([top_k_index, bits], -1).reshape(-1, 2), dim=0).tolist()
        combos = [(e, p) for e, p in combos if p >= 0]  # (expert, precision) pairs computed, deferred left out
        slot_index = torch.full_like(top_k_index, -1)
        for slot, (expert_id, precision) in enumerate(combos):
            slot_index[(top_k_index == expert_id) & (bits == precision)] = slot

        def load(slot: int) -> ExpertWeights:
            return self._expert(layer, int(combos[slot][0]), int(combos[slot][1]))

        return stacked_forward(module, load, len(combos), hidden, slot_index, weights)

    def _served_routing(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
        """`top_k_index` with each segment's tokens routed as its recorded digest says."""
        for seg in self.segments:
            recorded = self.trace.routing.get(seg.step_id, {}).get(layer)
            if recorded is None:
                continue
            lo = seg.start - self.start
            rows = slice(lo, lo + seg.num_tokens)
            where = f"request {self.trace.request_id}: step {seg.step_id}, layer {layer}"

            def scores(rows: slice = rows, where: str = where) -> torch.Tensor:
                found = self.engine.router_scores(layer, hidden[rows])
                if found is None:
                    raise RoutingError(f"{where}: the replay's routing differs from the served one and layer "
                                       f"{layer}'s router gives no scores to find near-ties with")  # fmt: skip
                return found

            positions = np.arange(seg.start, seg.start + seg.num_tokens)
            served, num_swaps = served_routing(top_k_index[rows], positions, recorded, scores, where)
            if num_swaps:
                top_k_index = top_k_index.clone()
                top_k_index[rows] = served
                self.num_routing_swaps += num_swaps
        return top_k_index

    def _token_bits(self, layer: int, top_k_index: torch.Tensor) -> torch.Tensor:
        bits = torch.zeros_like(top_k_index)
        by_step: dict[int, ExpertActions] = {}
        for step in set(self.token_steps):
            actions = self.trace.experts.get((step, self.is_rebuild))
            if actions is not None and (layer in actions.deferred or layer in actions.lowbit):
                by_step[step] = actions
        if not by_step:
            return bits
        experts = top_k_index.tolist()
        for token, step in enumerate(self.token_steps):
            actions = by_step.get(step)
            if actions is None:
                continue
            deferred, lowbit = actions.deferred.get(layer, set()), actions.lowbit.get(layer, {})
            for slot, expert_id in enumerate(experts[token]):
                if expert_id in deferred:
                    bits[token, slot] = -1
                elif expert_id in lowbit:
                    bits[token, slot] = lowbit[expert_id]
        return bits

    def _expert(self, layer: int, expert_id: int, bits: int) -> ExpertWeights:
        """The expert's weights from the checkpoint files (verified), low-bit round-tripped when `bits`."""
        full = self.engine.audit_expert((layer, expert_id))
        if not bits:
            return full
        key = (layer, expert_id, bits)
        if key not in self._lowbit:
            self._lowbit[key] = lowbit_round_trip(full, bits, self.engine.device)
            if len(self._lowbit) > MAX_CACHED_EXPERTS:
                self._lowbit.popitem(last=False)
        return self._lowbit[key]


def replay_logits(engine: BaselineEngine, trace: ReplayTrace, max_rows: int = 32) -> Iterator[torch.Tensor]:
    """The replay's logits for one request's output tokens, in order, as [<= max_rows, vocab] chunks (see
    the module docstring)."""
    return Replayer(engine, trace).run(max_rows)
