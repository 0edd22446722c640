"""One simulation configuration's run over a trace's grouped accesses: the controller's decisions step by step on a
simulated device, the I/O they issue and their outcome (see :mod:`fallbackgate.tracing.simulate` for what is
simulated and what is simplified)."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import numpy as np

from fallbackgate.controllers.registry import make_controller
from fallbackgate.engine.controller import Controller, ExpertMiss, KVMiss
from fallbackgate.engine.messages import StepKind, StepPlan
from fallbackgate.engine.tags import Exactness, Tag, Tier
from fallbackgate.tracing.sim_prefix import KeptPrefixes
from fallbackgate.tracing.simulate import MAX_KV_BYTES_SCALE, SimulatedView, SimulationConfig, _copies
from fallbackgate.tracing.simulate_input import SimulationInput

GIB = float(1 << 30)


class IOOp(NamedTuple):
    """One transfer a simulated decision issues (what ``--io real`` performs)."""

    op: str  # read or write
    kind: str  # expert or kv_block
    key: tuple  # the object's key
    num_bytes: int
    layer: int  # the layer whose attention or MoE waits on it (demand reads)
    requester: str  # demand, prefetch or spill


@dataclasses.dataclass(slots=True)
class _Tally:
    hits: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # kind -> hits
    tags: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # tag -> misses
    bytes_by_tag: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    spill_bytes: int = 0  # device -> host writes of KV taken off device
    prefetch_bytes: int = 0  # step-end expert loads
    num_invalid: int = 0  # decisions the object's copies could not serve (served by recompute / exact load)
    num_unfit_gathers: int = 0  # step x layer gathers whose K/V did not fit the budget (the engine would raise)


class Simulator:
    """One configuration's run over one input."""

    def __init__(self, data: SimulationInput, config: SimulationConfig):
        m = data.model
        self.data, self.config = data, config
        if not (0 < config.expert_bytes_scale <= 1 and 0 < config.kv_bytes_scale <= MAX_KV_BYTES_SCALE):
            raise ValueError(f"bytes scales must be in (0, 1] (KV: (0, {MAX_KV_BYTES_SCALE:g}]): experts "
                             f"{config.expert_bytes_scale}, KV {config.kv_bytes_scale}")  # fmt: skip
        self.view = SimulatedView(config.device, config.budget_bytes, m["num_layers"], m["num_experts"],
                                  max(1, round(m["bytes_per_expert"] * config.expert_bytes_scale)),
                                  max(1, round(m["bytes_per_kv_block"] * config.kv_bytes_scale)),
                                  m.get("block_size", 16), data.classes)  # fmt: skip
        self.view.num_expert_params = m["bytes_per_expert"] // 2  # as without a what-if: compression keeps them
        self.view.num_expert_layers = int(m.get("num_moe_layers") or m["num_layers"])
        self.controller: Controller = make_controller(
            config.controller, top_k=m.get("top_k", 1), expert_fraction=config.expert_fraction
        )
        if data.last_read and data.is_prefix_reused:
            self.view.prefix = KeptPrefixes(m["num_layers"], data.last_read)
        self.tally = _Tally()
        self.ops: list[list[IOOp]] | None = None  # per step, when recording: the I/O its decisions issue

    def make_room(self, need: int, pinned_e: set, pinned_kv: set, is_kv_evictable: bool = True) -> bool:
        """Free ``need`` bytes with the controller's victims; whether they fit now. As in the engine, an
        expert's placement (``is_kv_evictable`` False) takes room from other experts only, never from KV."""
        view = self.view
        if view.device_free_bytes >= need:
            return True
        for victim in self.controller.choose_victims(need - view.device_free_bytes, view, pinned_e, pinned_kv):
            if view.device_free_bytes >= need:
                break
            if victim.expert_key is not None and victim.expert_key in view.experts:
                if victim.expert_key not in pinned_e:
                    del view.experts[victim.expert_key]
            elif victim.kv_block_key is not None and is_kv_evictable and victim.kv_block_key not in pinned_kv:
                self.take_off(victim.kv_block_key, victim.spill_mode)
        return view.device_free_bytes >= need

    def take_off(self, key: tuple[str, int, int], mode: Any) -> None:
        """Take a device KV block off the device, leaving the copies `mode` says (spill bytes counted)."""
        view = self.view
        if key in view.kv and view.kv[key][0] is Tier.DEVICE:
            exact, quant, bits = _copies(mode)
            view.set_kv(key, (exact, quant, bits))
            num = (view.bytes_per_kv_block if exact else 0) + view.bytes_per_kv_block * bits // 16
            self.tally.spill_bytes += num
            if self.ops is not None and num:
                self.ops[-1].append(IOOp("write", "kv_block", key, num, key[1], "spill"))

    def note_served(self, tag: Tag, request_ids: list[str]) -> None:
        """A tag that is not exact taints what the requests compute from this step's block on (never kept)."""
        if tag.exactness is not Exactness.EXACT and self.view.prefix is not None:
            for request_id in dict.fromkeys(request_ids):
                self.view.prefix.taint(request_id, self.view.max_block[request_id])

    def place_kv(self, key: tuple[str, int, int]) -> None:
        """Put a KV block on the device (its only copy)."""
        self.view.set_kv(key, (Tier.DEVICE, None, 0))

    def kv_read(self, index: int, key: tuple[str, int, int], pinned: tuple[set, set], content_hash: int = 0) -> int:
        """Serve one KV read; returns the bytes it moved on demand."""
        view, t = self.view, self.tally
        copies = view.kv.get(key)
        view.max_block[key[0]] = max(view.max_block[key[0]], key[2])
        if view.prefix is not None:
            view.prefix.note(key, content_hash)
            if copies is None and view.prefix.adopt(view, key, content_hash, index):  # every layer's, read
                copies = view.kv[key]  # where it is
        if copies is None:  # the block's write: its room is made before the forward, as the engine's append
            if self.make_room(view.bytes_per_kv_block, set(), pinned[1]):  # does: no expert is pinned yet
                self.place_kv(key)
            else:
                view.set_kv(key, (Tier.HOST, None, 0))
                t.spill_bytes += view.bytes_per_kv_block
                if self.ops is not None:
                    self.ops[-1].append(IOOp("write", "kv_block", key, view.bytes_per_kv_block, key[1], "spill"))
            return 0
        if copies[0] is Tier.DEVICE:
            t.hits["kv"] += 1
            return 0
        miss = KVMiss(self.data.step_ids[index], key[0], view.request_class(key[0]), key[1], key[2], copies[0],
                      copies[1], copies[2], view.bytes_per_kv_block)  # fmt: skip
        tag = self.controller.kv_action(miss).tag
        moved = 0
        if tag is Tag.KV_DEQUANT and copies[1] is not None:
            moved = view.bytes_per_kv_block * copies[2] // 16
        elif tag is Tag.EXACT_LOAD and copies[0] is not None:
            moved = view.bytes_per_kv_block
        elif tag is not Tag.RECOMPUTE:
            t.num_invalid += 1
            tag = Tag.RECOMPUTE
        view.staged[key] = tag  # read into scratch this step: the controller may promote it at the step's end
        self.note_served(tag, [key[0]])
        t.tags[f"kv:{tag.value}"] += 1
        t.bytes_by_tag[f"kv:{tag.value}"] += moved
        if self.ops is not None and moved:
            self.ops[-1].append(IOOp("read", "kv_block", key, moved, key[1], "demand"))
        return moved

    def expert_use(self, index: int, key: tuple[int, int], rows: list, pinned: tuple[set, set]) -> int:
        """Serve one expert used by ``rows`` (layer, expert, request, weight) this step; returns demand bytes."""
        view, t = self.view, self.tally
        if key in view.experts:
            t.hits["expert"] += 1
            return 0
        request = rows[0][2]
        miss = ExpertMiss(self.data.step_ids[index], request, view.request_class(request), key[0], key[1], len(rows),
                          max(r[3] for r in rows), Tier.HOST, view.bytes_per_expert, True,
                          view.device_free_bytes >= view.bytes_per_expert, view.compute_dtype)  # fmt: skip
        tag = self.controller.expert_action(miss).tag
        self.note_served(tag, [r[2] for r in rows])
        moved = {Tag.EXACT_LOAD: view.bytes_per_expert, Tag.EXPERT_LOWBIT: view.bytes_per_expert // 2}.get(tag, 0)
        if tag is Tag.EXACT_LOAD and self.make_room(view.bytes_per_expert, *pinned, is_kv_evictable=False):
            view.experts[key] = None
        if tag is Tag.EXPERT_DEFER:
            self.deferred.append(key)
        t.tags[f"expert:{tag.value}"] += 1
        t.bytes_by_tag[f"expert:{tag.value}"] += moved
        if self.ops is not None and moved:
            self.ops[-1].append(IOOp("read", "expert", key, moved, key[0], "demand"))
        return moved

    def step(self, index: int) -> tuple[int, int]:
        """Run one step; returns (demand reads, demand bytes)."""
        data, view = self.data, self.view
        requests = data.step_requests[index]
        view.running_ids, view.step_index = tuple(requests), index
        phase = data.phases[index]
        kind = StepKind.PREFILL if phase == "prefill" else StepKind.MIXED if phase == "mixed" else StepKind.DECODE
        plan = StepPlan(data.step_ids[index], kind, list(requests), dict.fromkeys(requests, 1),
                        {r: view.num_kv_tokens(r) for r in requests})  # fmt: skip
        self.controller.on_step_start(plan, view)
        kv_rows, expert_rows = data.kv_rows[index], data.expert_rows[index]
        by_expert: dict[tuple[int, int], list] = {}
        for row in expert_rows:
            by_expert.setdefault((row[0], row[1]), []).append(row)
        pinned = (set(by_expert), set(kv_rows))
        self.deferred: list[tuple[int, int]] = []
        reads = moved = 0
        layers = sorted({r[1] for r in kv_rows} | {k[0] for k in by_expert})
        kv_by_layer: dict[int, list] = collections.defaultdict(list)
        for key, content_hash in zip(kv_rows, data.kv_hashes[index], strict=True):
            kv_by_layer[key[1]].append((key, content_hash))
        experts_by_layer: dict[int, list] = collections.defaultdict(list)
        for key in by_expert:
            experts_by_layer[key[0]].append(key)
        for layer in layers:  # attention reads the layer's KV and gathers it, then its MoE uses the experts
            staged = set()
            for key, content_hash in kv_by_layer[layer]:
                num = self.kv_read(index, key, pinned, content_hash)
                reads, moved = reads + (num > 0), moved + num
                if num:
                    staged.add(key)
            self.gather([key for key, _ in kv_by_layer[layer]], staged, pinned[1])
            layer_pins = (set(experts_by_layer[layer]), pinned[1])  # the engine pins the layer's experts only
            for key in experts_by_layer[layer]:
                num = self.expert_use(index, key, by_expert[key], layer_pins)
                reads, moved = reads + (num > 0), moved + num
        view.used_expert_keys, view.used_kv_block_keys = tuple(by_expert), tuple(kv_rows)
        view.deferred_expert_keys = tuple(self.deferred)
        self.step_end()
        self.free(data.finished[index], index)
        return reads, moved

    def gather(self, keys: list[tuple[str, int, int]], staged: set, pinned_kv: set) -> None:
        """Make room for one layer's gathered K/V, as the engine's ``ensure_room`` does with no expert pinned:
        every block of a request that has more than one, and a one-block request's block when it was read from
        off device (`staged`). The room goes back to the experts when they run, so only the evictions remain.
        Where the budget cannot hold it (a larger-KV what-if), the engine would refuse the step; the simulator
        goes on and counts it (``num_unfit_gathers``), so such a configuration is one the engine cannot serve."""
        blocks = collections.Counter(key[0] for key in keys)
        need = sum(n for n in blocks.values() if n > 1) + sum(1 for key in staged if blocks[key[0]] == 1)
        if need and not self.make_room(need * self.view.bytes_per_kv_block, set(), pinned_kv):
            self.tally.num_unfit_gathers += 1  # only a what-if's larger KV gets here: a recorded run fitted

    def free(self, request_ids: list[str], index: int) -> None:
        """Free the KV blocks of requests that ended at step `index`, but for those kept as prefix blocks (the
        engine's prefix reuse keeps a finished request's full exact blocks, then prunes dead entries)."""
        view = self.view
        gone = set(request_ids)
        if not gone:
            return
        mine: dict[str, dict[int, list]] = {rid: collections.defaultdict(list) for rid in gone}
        for key in [k for k in view.kv if k[0] in gone]:
            mine[key[0]][key[2]].append(key)
        for rid, blocks in mine.items():
            if view.prefix is not None:
                view.prefix.keep(view, rid, blocks, index)
            for keys in blocks.values():
                for key in keys:
                    if key in view.kv:
                        view.drop_kv(key)
        if view.prefix is not None:
            view.prefix.prune(view)

    def step_end(self) -> None:
        """Carry out the controller's step-end actions: spills, evictions, promotions, prefetches."""
        view, t = self.view, self.tally
        actions = self.controller.on_step_end(view)
        for key, mode in actions.spill:
            self.take_off(key, mode)
        for key in actions.evict_experts:
            view.experts.pop(key, None)
        for key in actions.promote_kv:
            if key in view.staged and view.kv.get(key, (None,))[0] is not Tier.DEVICE:
                if self.make_room(view.bytes_per_kv_block, set(), set()):
                    self.place_kv(key)
        view.staged.clear()
        for key in actions.load_experts:  # prefetches start only into free room, as the engine's do
            if key not in view.experts and view.device_free_bytes >= view.bytes_per_expert:
                view.experts[key] = None
                t.prefetch_bytes += view.bytes_per_expert
                if self.ops is not None:
                    self.ops[-1].append(IOOp("read", "expert", key, view.bytes_per_expert, key[0], "prefetch"))

    def decide(self, is_recording: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Every step's decisions; per step (demand reads, demand bytes). ``is_recording`` keeps each step's
        I/O in :attr:`ops` (for ``--io real``)."""
        n = len(self.data.step_ids)
        reads, moved = np.zeros(n), np.zeros(n)
        self.ops = [] if is_recording else None
        for index in range(n):
            if self.ops is not None:
                self.ops.append([])
            reads[index], moved[index] = self.step(index)
        return reads, moved

    def run(self) -> dict[str, Any]:
        """Every step; the configuration's outcome on its device model."""
        reads, moved = self.decide()
        return self.result(self.config.device.stall_ns(reads, moved))

    def result(self, stall_ns: np.ndarray) -> dict[str, Any]:
        """The outcome with each step lasting its compute and ``stall_ns`` (and the host time before it)."""
        timeline = self.data.timeline
        outcome = timeline.outcome(timeline.compute_ns + stall_ns)
        outcome["stall_s"] = float(np.sum(stall_ns) / 1e9)
        before = timeline.before_ns if timeline.before_ns is not None else 0.0
        run_s = float(np.sum(timeline.compute_ns + stall_ns + before) / 1e9)  # every step, end to end
        with_slo = int(np.sum(~np.isnan(timeline.request_slo_ns)))
        t = self.tally
        return {
            "controller": self.config.controller, "budget_gib": self.config.budget_bytes / GIB,
            "expert_fraction": self.config.expert_fraction, "device": self.config.device.name,
            "expert_bytes_scale": self.config.expert_bytes_scale, "kv_bytes_scale": self.config.kv_bytes_scale,
            "expert_hits": t.hits["expert"], "kv_hits": t.hits["kv"], "misses_by_tag": dict(t.tags),
            "bytes_by_tag": dict(t.bytes_by_tag), "spill_bytes": t.spill_bytes, "prefetch_bytes": t.prefetch_bytes,
            "num_invalid_decisions": t.num_invalid, "num_unfit_gathers": t.num_unfit_gathers,
            "stall_s": outcome["stall_s"], "run_s": run_s,
            "p99_tpot_ms": outcome["p99_tpot_ms"], "mean_tpot_ms": outcome["mean_tpot_ms"],
            "slo_attainment": 1 - outcome["slo_violations"] / with_slo if with_slo else float("nan"),
        }  # fmt: skip
