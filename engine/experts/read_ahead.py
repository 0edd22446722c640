"""Expert reads from the checkpoint on I/O threads, ahead of their use, and the step's transfer clock.

Reads go through the engine's I/O scheduler (when the checkpoint files have one): the threads submit an
expert's spans and wait for them off the compute thread, so the compute thread waits only at use
(:meth:`ReadAhead.take`); a read ahead of the current layer's own miss is served as a miss, a predicted one
after every miss and KV read. Mechanism only: the controller chooses what to read ahead
(:meth:`Controller.choose_read_ahead`); the store reserves host-budget room for each read before it starts,
and a demand read of a key in flight waits for it rather than reading again. On a 2-core CPU machine the
I/O threads take CPU from torch's compute threads (measured: more than the reads they hide), so the engine
defaults to none there.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from fallbackgate.engine.experts.weights import HeldWeights
from fallbackgate.engine.io.context import IOPriority, current_io_context, io_context

ExpertKey = tuple[int, int]
Read = tuple[HeldWeights, str]  # the weights and a note for the ledger (e.g. a cleared checksum fault)


@dataclasses.dataclass(slots=True)
class TransferClock:
    """Disk-read time of one step: all of it, the part the compute thread waited for, and the reads."""

    transfer_s: float = 0.0  # seconds of expert disk reads finished for this step (in whichever thread)
    exposed_s: float = 0.0  # seconds the compute thread spent in or waiting for those reads
    num_predicted: int = 0  # reads started for the next layer's predicted experts
    num_predicted_used: int = 0  # reads a layer needed that a prediction had started (prefetch hits)
    num_unpredicted: int = 0  # reads a layer needed that no prediction had started (prefetch misses)

    @property
    def hidden_s(self) -> float:
        """Read time that overlapped compute."""
        return max(self.transfer_s - self.exposed_s, 0.0)

    def add(self, other: TransferClock) -> None:
        """Add `other`'s figures to these."""
        for field in dataclasses.fields(TransferClock):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def summary(self) -> dict[str, float | int | None]:
        """Read time in all, hidden and exposed, and the next-layer prediction's precision (started reads a
        layer used) and recall (needed reads it had started); None where there is nothing to divide."""
        used, predicted, unpredicted = self.num_predicted_used, self.num_predicted, self.num_unpredicted
        return {
            "read_s": self.transfer_s,
            "hidden_s": self.hidden_s,
            "exposed_s": self.exposed_s,
            "hidden_fraction": self.hidden_s / self.transfer_s if self.transfer_s > 0 else None,
            "num_predicted": predicted,
            "num_predicted_used": used,
            "num_unpredicted": unpredicted,
            "prefetch_precision": used / predicted if predicted else None,
            "prefetch_recall": used / (used + unpredicted) if used + unpredicted else None,
        }


@dataclasses.dataclass(slots=True)
class _Flight:
    future: Future  # resolves to ((weights, note), seconds the read took, when its disk transfer finished)
    step_id: int  # step that started it
    is_predicted: bool  # started for a predicted next-layer expert (not for the current layer's own routing)


class ReadAhead:
    """A pool of I/O threads reading experts ahead of use; `take` hands a read over to its consumer."""

    def __init__(self, read: Callable[[ExpertKey], Read], num_threads: int) -> None:
        self.read = read
        self.pool = ThreadPoolExecutor(num_threads, thread_name_prefix="fallbackgate-read") if num_threads else None
        self.flights: dict[ExpertKey, _Flight] = {}
        self.clock = TransferClock()
        self.total = TransferClock()  # the whole run

    def _timed(self, key: ExpertKey, requester_ids: tuple[str, ...], priority: int | None) -> tuple[Read, float, int]:
        """Read `key` through the I/O scheduler for `requester_ids` at `priority`: the read, its seconds and
        when its last disk transfer finished (monotonic ns; 0 when nothing went through the scheduler)."""
        started = time.perf_counter()
        with io_context(requester_ids, priority, f"{key[0]}:{key[1]}") as ctx:
            got = self.read(key)
        return got, time.perf_counter() - started, ctx.last_end_ns

    def is_in_flight(self, key: ExpertKey) -> bool:
        return key in self.flights

    def start(self, key: ExpertKey, step_id: int, is_predicted: bool) -> None:
        """Start reading `key` (the caller has reserved its host room)."""
        if self.pool is None:
            raise RuntimeError("read-ahead has no I/O threads")
        priority = IOPriority.READ_AHEAD if is_predicted else IOPriority.EXPERT_MISS
        future = self.pool.submit(self._timed, key, current_io_context().requester_ids, priority)
        self.flights[key] = _Flight(future, step_id, is_predicted)
        self.clock.num_predicted += int(is_predicted)

    def take(self, key: ExpertKey) -> Read:
        """The weights of a read in flight, waiting for it if needed (the wait is exposed time); a read
        that failed raises its error here, in the consumer's thread."""
        flight = self.flights.pop(key)
        started = time.perf_counter()
        got, read_s, end_ns = flight.future.result()
        current_io_context().note_end(end_ns)  # the consumer's object arrived when the read finished
        # a wait longer than the read itself queued behind other reads: counted up to the read's own time, so
        # exposed never exceeds transfer (the rest of such a wait is not in the clock)
        self.clock.exposed_s += min(time.perf_counter() - started, read_s)
        self.clock.transfer_s += read_s
        if flight.is_predicted:
            self.clock.num_predicted_used += 1
        else:
            self.clock.num_unpredicted += 1
        return got

    def demand_read(self, key: ExpertKey) -> Read:
        """A read nothing started ahead: all of it is exposed."""
        outer = current_io_context()
        got, read_s, end_ns = self._timed(key, outer.requester_ids, outer.priority)
        outer.note_end(end_ns)
        self.clock.transfer_s += read_s
        self.clock.exposed_s += read_s
        self.clock.num_unpredicted += 1
        return got

    def finished_before(self, step_id: int) -> list[tuple[ExpertKey, HeldWeights | None]]:
        """Reads started before `step_id`, finished and not taken: their results (None for a failed read),
        removed. Reads still running stay in flight (nothing waits for them here)."""
        out = []
        for key in [k for k, f in self.flights.items() if f.step_id < step_id and f.future.done()]:
            flight = self.flights.pop(key)
            try:
                (weights, _), read_s, _ = flight.future.result()
            except Exception:  # noqa: BLE001 - an unused read that failed is simply dropped
                out.append((key, None))
                continue
            self.clock.transfer_s += read_s  # overlapped compute entirely: nothing waited for it
            out.append((key, weights))
        return out

    def end_step(self) -> TransferClock:
        """This step's clock, added to the run's total; a fresh clock for the next step."""
        clock, self.clock = self.clock, TransferClock()
        self.total.add(clock)
        return clock

    def close(self) -> None:
        """Wait for reads in flight and stop the threads."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
