"""Continuous batching: admit while KV fits, batch decodes with prefill chunks, preempt when short."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container

from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.device_pool import Scratch
from fallbackgate.engine.errors import BudgetError
from fallbackgate.engine.kv.store import KVBlockKey, KVStore, RequestBlockKeys, Staged
from fallbackgate.engine.messages import StepKind, StepPlan
from fallbackgate.engine.sequence import Sequence, SequenceStatus
from fallbackgate.engine.tags import ObjectKind

# (bytes needed, pinned KV blocks, condition that says "enough", only KV may go) -> whether it became true
RoomMaker = Callable[[int, Container[KVBlockKey], Callable[[], bool], bool], bool]


class Scheduler:
    """Chooses which requests run each step and how many tokens each feeds."""

    def __init__(
        self,
        config: EngineConfig,
        kv_store: KVStore,
        make_room: RoomMaker,
        expert_floor_bytes: int,
        preempt: Callable[[Sequence], None],
    ) -> None:
        self.config, self.kv_store, self.make_room, self.preempt_fn = config, kv_store, make_room, preempt
        self.expert_floor_bytes = expert_floor_bytes  # device bytes KV may never take from expert slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.restored: list[tuple[str, Staged]] = []  # tail blocks brought back on resume, for the step's log
        self.step_id = 0
        self.chosen: list[tuple[Sequence, int]] = []  # the step being scheduled, so far
        self.is_layer_staged = False  # the step's KV does not fit at once: off-device blocks are staged per layer
        self.adopt: Callable[[Sequence], int] | None = None  # kept prefix blocks a new request takes (prefix reuse)

    def add(self, seq: Sequence) -> None:
        self.check_fits_alone(seq.request_id, seq.num_tokens + seq.params.max_new_tokens)
        self.waiting.append(seq)

    def check_fits_alone(self, request_id: str, num_tokens: int) -> None:
        """Refuse a request that could not run even alone at its full length. It runs with all its KV blocks
        on device when they fit beside the expert floor (and beside one layer's gathered K/V); else with only
        the blocks it writes on device (one per layer) and one layer's K/V laid out at a time, staged from
        wherever its blocks are (per-layer staging), which must fit the budget with one block's staging."""
        kv, pool = self.kv_store, self.kv_store.device_pool
        num_blocks = -(-num_tokens // kv.block_size)
        blocks = num_blocks * kv.num_layers * kv.bytes_per_block
        gathered = kv.attend_bytes([num_tokens])
        kv_cap = pool.budget_bytes - self.expert_floor_bytes
        if blocks <= kv_cap and blocks + gathered <= pool.budget_bytes:
            return
        written = kv.num_layers * kv.bytes_per_block
        if written <= kv_cap and written + gathered + kv.max_stage_bytes <= pool.budget_bytes:
            return
        raise BudgetError(
            f"request {request_id}: {num_tokens} tokens need {blocks} B of KV blocks, and even staged layer by layer "
            f"one layer's K/V ({gathered} B) beside the {written} B it writes and {kv.max_stage_bytes} B of staging, "
            f"but the device budget is {pool.budget_bytes} B with {self.expert_floor_bytes} B kept for expert slots; "
            "raise the device budget or lower max_new_tokens"
        )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> tuple[StepPlan, list[tuple[Sequence, int]]]:
        """Pick (sequence, num_tokens) pairs for the next forward and build its plan."""
        self.step_id += 1
        self.is_layer_staged = False
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        self.chosen = chosen
        preempted_before = {s.request_id for s in self.swapped}
        for seq in list(self.running):
            if budget == 0 or seq.status is not SequenceStatus.RUNNING:
                continue
            num = self._fit(seq, min(seq.num_pending_tokens, budget), chosen, may_preempt=True)
            if num:
                self._allocate(seq, num, chosen)
                budget -= num
        resumed = self._admit(chosen, budget)
        if not chosen:
            pool = self.kv_store.device_pool
            waiting = [s.request_id for s in list(self.running) + list(self.swapped) + list(self.waiting)][:5]
            raise BudgetError(
                f"no request fits on device this step (requests {waiting}): device budget {pool.budget_bytes} B, "
                f"{pool.free_bytes} B free, {self.expert_floor_bytes} B kept for expert slots; raise the device budget"
            )
        return self._plan(chosen, resumed, preempted_before), chosen

    def _admit(self, chosen: list[tuple[Sequence, int]], budget: int) -> list[str]:
        resumed: list[str] = []
        for queue in (self.swapped, self.waiting):
            while queue and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = queue[0]
                if seq.request_id not in self.kv_store.tables:
                    self.kv_store.add_sequence(seq.request_id)
                    if self.adopt is not None:
                        self.adopt(seq)  # its prefill then starts after the blocks it took
                num = self._fit(seq, min(seq.num_pending_tokens, budget), chosen, may_preempt=False)
                if not num:
                    return resumed
                queue.popleft()
                if seq.status is SequenceStatus.SWAPPED:
                    resumed.append(seq.request_id)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                self._allocate(seq, num, chosen)
                budget -= num
        return resumed

    def _allocate(self, seq: Sequence, num: int, chosen: list[tuple[Sequence, int]]) -> None:
        self.restored += [(seq.request_id, staged) for staged in self.kv_store.append(seq.request_id, num)]
        self.kv_store.clear_scratch()
        chosen.append((seq, num))

    def _fit(self, seq: Sequence, num: int, chosen: list[tuple[Sequence, int]], may_preempt: bool) -> int:
        """Largest token count <= num whose KV fits on device, making room or preempting as allowed."""
        while num > 0:
            if self._try_room(seq, num, chosen):
                return num
            partial = self._largest_fitting(seq, num - 1)
            if partial:
                return partial
            victim = self._preemption_victim(seq, chosen) if may_preempt else None
            if victim is None:
                is_alone = not chosen and (may_preempt or not self.running)  # waiting would not help it
                return self._fit_layered(seq, num, chosen) if is_alone else 0
            self.preempt(victim)
        return 0

    def _fit_layered(self, seq: Sequence, num: int, chosen: list[tuple[Sequence, int]]) -> int:
        """Largest token count <= num that fits with per-layer staging (the request alone in the step, with
        nothing left to preempt): only the blocks the step writes must be on device; the step is marked
        layered."""
        fitted = num if self._try_room_layered(seq, num, chosen) else self._largest_fitting(seq, num - 1, True)
        self.is_layer_staged = self.is_layer_staged or fitted > 0
        return fitted

    def _fits(self, seq: Sequence, num: int) -> bool:
        """Whether `seq` can join this step with `num` tokens: its new KV blocks fit the device pool now,
        and the step's KV (blocks, the off-device blocks it stages, then one layer's gathered K/V) stays
        within the budget, leaving the expert floor free while experts run (the gather is released first)."""
        pool = self.kv_store.device_pool
        kv_after = self._kv_after(seq, num)
        gathered = self._gathered_bytes(seq, num)
        kv_cap = pool.budget_bytes - self.expert_floor_bytes
        need = self.kv_store.bytes_to_append(seq.request_id, num)
        return pool.can_reserve(need) and kv_after <= kv_cap and kv_after + gathered <= pool.budget_bytes

    def _fits_layered(self, seq: Sequence, num: int) -> bool:
        """Whether `seq` can join with `num` tokens when the step stages per layer: its new blocks fit now,
        the blocks held stay within the KV cap, and with one layer's K/V laid out (and one block's staging)
        within the budget."""
        kv, pool = self.kv_store, self.kv_store.device_pool
        need = kv.bytes_to_append(seq.request_id, num)
        held = pool.used_bytes_by_kind[ObjectKind.KV_BLOCK] + pool.used_bytes_by_kind[Scratch.KV_STAGED] + need
        layer = self._gathered_bytes(seq, num) + kv.max_stage_bytes
        return (
            pool.can_reserve(need)
            and held <= pool.budget_bytes - self.expert_floor_bytes
            and held + layer <= pool.budget_bytes
        )

    def _try_room_layered(self, seq: Sequence, num: int, chosen: list[tuple[Sequence, int]]) -> bool:
        if self._fits_layered(seq, num):
            return True
        kv, pool = self.kv_store, self.kv_store.device_pool
        need = kv.bytes_to_append(seq.request_id, num)
        is_kv_only = pool.used_bytes_by_kind[ObjectKind.KV_BLOCK] + need > pool.budget_bytes - self.expert_floor_bytes
        pinned = self._pinned_tails(chosen, seq, is_whole_pinned=False)
        return self.make_room(need, pinned, lambda: self._fits_layered(seq, num), is_kv_only)

    def _kv_after(self, seq: Sequence, num: int) -> int:
        """Device KV bytes once `seq` joins with `num` tokens: blocks held, its new blocks, the step's staging."""
        need = self.kv_store.bytes_to_append(seq.request_id, num)
        return self.kv_store.device_pool.used_bytes_by_kind[ObjectKind.KV_BLOCK] + need + self._staged_bytes(seq)

    def _members(self, seq: Sequence, num: int) -> list[tuple[Sequence, int]]:
        return [(s, n) for s, n in self.chosen if s is not seq] + [(seq, num)]

    def _staged_bytes(self, seq: Sequence) -> int:
        """Scratch of the step's off-device blocks (staged for it: exact_load, kv_dequant, recompute)."""
        kv = self.kv_store
        return sum(kv.bytes_to_stage(s.request_id, s.num_computed_tokens) for s, _ in self._members(seq, 0))

    def _gathered_bytes(self, seq: Sequence, num: int) -> int:
        return self.kv_store.attend_bytes([s.num_computed_tokens + n for s, n in self._members(seq, num)])

    def _try_room(self, seq: Sequence, num: int, chosen: list[tuple[Sequence, int]]) -> bool:
        if self._fits(seq, num):
            return True
        need = self.kv_store.bytes_to_append(seq.request_id, num)
        is_kv_only = self._kv_after(seq, num) > self.kv_store.device_pool.budget_bytes - self.expert_floor_bytes
        return self.make_room(need, self._pinned_tails(chosen, seq), lambda: self._fits(seq, num), is_kv_only)

    def _largest_fitting(self, seq: Sequence, num: int, is_layered: bool = False) -> int:
        """Binary search for the most tokens (<= num) that fit on device as it is now (a prefill chunk)."""
        fits = self._fits_layered if is_layered else self._fits
        low, high = 0, num
        while low < high:
            mid = (low + high + 1) // 2
            if fits(seq, mid):
                low = mid
            else:
                high = mid - 1
        return low

    def _pinned_tails(
        self, chosen: list[tuple[Sequence, int]], seq: Sequence, is_whole_pinned: bool = True
    ) -> RequestBlockKeys:
        """Blocks that must stay on device: every running tail, and (`is_whole_pinned`) every block of this
        step's requests (spilling one would only move its bytes from a slot to the step's staging scratch;
        with per-layer staging it frees room for all the layers but the one being read)."""
        members = [*chosen, (seq, 0)] if is_whole_pinned else []
        pinned = self.kv_store.block_keys([s.request_id for s, _ in members])
        size = self.config.block_size
        writing = {s.request_id: s.num_computed_tokens for s, _ in chosen}
        for other in self.running + [seq]:
            used = self.kv_store.num_tokens.get(other.request_id, 0)
            first = writing.get(other.request_id, used) // size
            for layer in range(self.kv_store.num_layers):
                for index in range(first, max(first, -(-used // size) - 1) + 1):
                    pinned.add((other.request_id, layer, index))
        return pinned

    def _preemption_victim(self, seq: Sequence, chosen: list[tuple[Sequence, int]]) -> Sequence | None:
        """The most recently admitted running request that is not already in this step."""
        taken = {s.request_id for s, _ in chosen} | {seq.request_id}
        for other in reversed(self.running):
            if other.request_id not in taken:
                return other
        return None

    def preempt(self, seq: Sequence) -> None:
        """Take `seq` off device (the engine swaps or drops its KV) and queue it to resume first."""
        self.running.remove(seq)
        self.preempt_fn(seq)
        seq.status = SequenceStatus.SWAPPED
        seq.num_preemptions += 1
        self.swapped.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        """Take an unfinished request out of whichever queue holds it (between steps)."""
        for queue in (self.waiting, self.running, self.swapped):
            for index, other in enumerate(queue):
                if other is seq:
                    del queue[index]
                    break
        seq.status = SequenceStatus.FINISHED

    def _plan(self, chosen: list[tuple[Sequence, int]], resumed: list[str], preempted_before: set[str]) -> StepPlan:
        kinds = {num == 1 and seq.num_computed_tokens >= len(seq.prompt_token_ids) for seq, num in chosen}
        kind = StepKind.DECODE if kinds == {True} else StepKind.PREFILL if kinds == {False} else StepKind.MIXED
        preempted = [s.request_id for s in self.swapped if s.request_id not in preempted_before]
        return StepPlan(
            step_id=self.step_id,
            kind=kind,
            request_ids=[s.request_id for s, _ in chosen],
            num_tokens={s.request_id: n for s, n in chosen},
            start_positions={s.request_id: s.num_computed_tokens for s, _ in chosen},
            preempted_ids=preempted,
            resumed_ids=resumed,
        )
