"""In-memory weight copies checked against the checkpoint: sampled expert copies while serving, every dense
weight before an audit trusts the model.

An expert copy (host cache or device slot) is checked against the manifest's xxh3-64 of the expert's bytes
in the files (cast back to the checkpoint dtype first; a compute dtype narrower than the checkpoint's cannot
be cast back exactly, so such copies are not sampled). A copy that fails is discarded (never cached
elsewhere), so the next use reads the files again. Dense weights are checked against digests of the file
tensors as the loader assigned them (after the dtype cast), taken when they were read.
"""

from __future__ import annotations

import bisect
import dataclasses
import random
from collections.abc import Mapping

import torch

from fallbackgate.engine.experts.manifest import weights_digest
from fallbackgate.engine.experts.store import ExpertKey, ExpertStore
from fallbackgate.engine.experts.weights import BlockScaled, ExpertWeights
from fallbackgate.engine.messages import Verification
from fallbackgate.engine.model.dense_loader import tensor_digest
from fallbackgate.engine.tags import Tier


def verify_dense(model: torch.nn.Module, digests: Mapping[str, str]) -> list[Verification]:
    """Check every dense weight the loader read against its load-time digest (one Verification each)."""
    live = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    out = []
    for name, expected in digests.items():
        tensor = live.get(name)
        passed = tensor is not None and tensor_digest(tensor) == expected
        note = "" if passed else ("missing from the model" if tensor is None else "bytes differ from the checkpoint")
        out.append(Verification(None, "dense", name, None, passed, note))
    return out


@dataclasses.dataclass(slots=True)
class CopyVerifier:
    """Checks `num_per_step` randomly chosen expert copies after each step (seeded, so runs repeat).

    The copies to choose from are kept sorted by (key, tier) and updated from the store's residency journal
    (only the keys whose copies came or went since the last step), never by a walk of every expert."""

    store: ExpertStore
    checkpoint_dtype: torch.dtype
    num_per_step: int = 1
    seed: int = 0
    rng: random.Random = dataclasses.field(init=False)
    copies: list[tuple[ExpertKey, int]] = dataclasses.field(init=False)  # (key, tier order), sorted
    cursor: int = dataclasses.field(init=False)  # into the store's journal

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.copies, self.cursor = [], -1

    @property
    def is_possible(self) -> bool:
        """False when the compute dtype cannot be cast back to the checkpoint's exactly."""
        reader = self.store.reader
        return reader.is_block_scaled or reader.compute_dtype.itemsize >= self.checkpoint_dtype.itemsize

    def verify_step(self, step_id: int) -> list[Verification]:
        """Verify sampled copies; discard those that fail. One Verification per copy checked."""
        if not self.num_per_step or not self.is_possible:
            return []
        copies = self._copies()
        chosen = self.rng.sample(copies, min(self.num_per_step, len(copies)))
        tiers = (Tier.DEVICE, Tier.HOST)  # a key's device copy is listed before its host copy
        return [self._verify(step_id, key, tiers[tier]) for key, tier in chosen]

    def _copies(self) -> list[tuple[ExpertKey, int]]:
        """Every device and host copy as (key, 0 device / 1 host), in key order: synced with the journal."""
        changed, self.cursor = self.store.journal.since(self.cursor)
        entries = self.store.entries
        if changed is None:  # the first step, or the journal moved past us: one walk
            held = ((k, (e.device, e.host)) for k, e in entries.items())
            self.copies = [(k, tier) for k, copies in held for tier, copy in enumerate(copies) if copy is not None]
            return self.copies
        for key in dict.fromkeys(changed):
            entry = entries[key]
            for tier, copy in enumerate((entry.device, entry.host)):  # the insertion keeps (key, tier) order
                i = bisect.bisect_left(self.copies, (key, tier))
                is_listed = i < len(self.copies) and self.copies[i] == (key, tier)
                if copy is not None and not is_listed:
                    self.copies.insert(i, (key, tier))
                elif copy is None and is_listed:
                    del self.copies[i]
        return self.copies

    def _verify(self, step_id: int, key: ExpertKey, tier: Tier) -> Verification:
        entry = self.store.entries[key]
        copy = entry.device if tier is Tier.DEVICE else entry.host
        assert copy is not None
        if tier is Tier.DEVICE and entry.ready is not None:  # a side-stream copy may still be writing it
            entry.ready.synchronize()
        reader = self.store.reader
        if isinstance(copy, BlockScaled):  # an FP8 host copy holds the codes and scales as the files do
            passed = weights_digest(ExpertWeights(copy.gate_up, copy.down), copy.scales) == reader.digests[key]
        elif reader.is_block_scaled:  # FP8 device copy: the dequantized weights a verified read produced
            as_computed = ExpertWeights(copy.gate_up.to("cpu"), copy.down.to("cpu"))
            passed = weights_digest(as_computed) == reader.compute_digest(key)
        else:
            dtype = self.checkpoint_dtype
            as_stored = ExpertWeights(copy.gate_up.to("cpu", dtype), copy.down.to("cpu", dtype))
            passed = weights_digest(as_stored) == reader.digests[key]
        note = ""
        if not passed:
            note = f"{tier.value} copy differs from the checkpoint's manifest"
            note += "; discarded" if self.store.discard_copy(key, tier) else "; pinned in its layer's stack, kept"
        return Verification(step_id, "expert", f"{key[0]}:{key[1]}", tier, passed, note)
