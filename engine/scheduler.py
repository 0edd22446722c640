"""Continuous batching: admit while KV fits, batch decodes with prefill chunks, preempt when short."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.errors import BudgetError
from fallbackgate.engine.kv_store import KVBlockKey, KVStore, Staged
from fallbackgate.engine.messages import StepKind, StepPlan
from fallbackgate.engine.sequence import Sequence, SequenceStatus
from fallbackgate.engine.tags import ObjectKind

# (bytes needed, pinned KV blocks, condition that says "enough", only KV may go) -> whether it became true
RoomMaker = Callable[[int, set[KVBlockKey], Callable[[], bool], bool], bool]


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

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> tuple[StepPlan, list[tuple[Sequence, int]]]:
        """Pick (sequence, num_tokens) pairs for the next forward and build its plan."""
        self.step_id += 1
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
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
                return 0
            self.preempt(victim)
        return 0

    def _fits(self, seq: Sequence, num: int) -> bool:
        need = self.kv_store.bytes_to_append(seq.request_id, num)
        pool = self.kv_store.device_pool
        kv_cap = pool.budget_bytes - self.expert_floor_bytes
        return pool.can_reserve(need) and pool.used_bytes_by_kind[ObjectKind.KV_BLOCK] + need <= kv_cap

    def _try_room(self, seq: Sequence, num: int, chosen: list[tuple[Sequence, int]]) -> bool:
        if self._fits(seq, num):
            return True
        need = self.kv_store.bytes_to_append(seq.request_id, num)
        pool = self.kv_store.device_pool
        is_kv_only = pool.used_bytes_by_kind[ObjectKind.KV_BLOCK] + need > pool.budget_bytes - self.expert_floor_bytes
        return self.make_room(need, self._pinned_tails(chosen, seq), lambda: self._fits(seq, num), is_kv_only)

    def _largest_fitting(self, seq: Sequence, num: int) -> int:
        """Binary search for the most tokens (<= num) that fit on device as it is now (a prefill chunk)."""
        low, high = 0, num
        while low < high:
            mid = (low + high + 1) // 2
            if self._fits(seq, mid):
                low = mid
            else:
                high = mid - 1
        return low

    def _pinned_tails(self, chosen: list[tuple[Sequence, int]], seq: Sequence) -> set[KVBlockKey]:
        """Blocks that must stay on device: every running tail, and every block this step writes."""
        pinned: set[KVBlockKey] = set()
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
