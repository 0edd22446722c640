"""Prometheus metrics of a serving engine (prometheus_client, one registry per server).

Updated by the engine loop after every step and request, and by a poller that reads the audits the
background workers wrote to the ledger (audited KL, gate failures). Times are measured wall clock.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from sqlalchemy import select
from sqlalchemy.exc import InterfaceError, OperationalError

from fallbackgate.engine.engine import Engine
from fallbackgate.engine.messages import RequestOutput, StepResult
from fallbackgate.engine.tags import ObjectKind, Tag
from fallbackgate.ledger.backlog import BufferState
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.models import Request, RequestStatRow, VerdictRow

TIME_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
KL_BUCKETS = (1e-12, 1e-9, 1e-6, 1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.5, 1.0, 5.0)


class ServerMetrics:
    """Every metric ``/metrics`` exposes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._declare_requests(self.registry)
        self._declare_objects(self.registry)
        self._declare_quality_and_ledger(self.registry)
        self._hits = self._misses = 0
        self._seen_stats: set[str] = set()
        self._seen_verdicts = 0
        self._slo_counts: dict[tuple[str, str], tuple[int, int]] = {}  # (class, slo) -> (met, checked)
        self._lock = threading.Lock()

    def _declare_requests(self, r: CollectorRegistry) -> None:
        """Requests: finished, in flight, queued; their measured times and SLOs; quarantined objects."""
        self.requests = Counter(
            "fallbackgate_requests", "Requests finished, by class and outcome", ["request_class", "outcome"], registry=r
        )
        self.in_flight = Gauge("fallbackgate_requests_in_flight", "Requests admitted and not finished", registry=r)
        self.queue_depth = Gauge("fallbackgate_queue_depth", "Requests waiting for their first step", registry=r)
        self.quarantined = Gauge(
            "fallbackgate_quarantined_objects", "Checkpoint objects quarantined: reads failed twice", registry=r
        )
        self.quarantined_object = Gauge(
            "fallbackgate_quarantined", "1 per quarantined object", ["object_kind", "object_id"], registry=r
        )
        self.ttft = Histogram(
            "fallbackgate_ttft_seconds",
            "Measured time to first token",
            ["request_class"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "fallbackgate_tpot_seconds",
            "Measured time per output token after the first",
            ["request_class"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.slo_met = Counter(
            "fallbackgate_slo_met", "Requests that met their class's SLO", ["request_class", "slo"], registry=r
        )
        self.slo_total = Counter(
            "fallbackgate_slo_checked",
            "Requests checked against their class's SLO",
            ["request_class", "slo"],
            registry=r,
        )
        self.slo_attainment = Gauge(
            "fallbackgate_slo_attainment", "Fraction of requests that met the SLO", ["request_class", "slo"], registry=r
        )

    def _declare_objects(self, r: CollectorRegistry) -> None:
        """Objects served and bytes moved by tag, kind and tier; fallbacks; pools; expert hits."""
        self.objects = Counter(
            "fallbackgate_objects", "Objects served, by tag, kind and source tier", ["tag", "kind", "tier"], registry=r
        )
        self.bytes = Counter(
            "fallbackgate_bytes",
            "Bytes moved over links, by tag, kind and source tier",
            ["tag", "kind", "tier"],
            registry=r,
        )
        self.kv_resident = Counter(
            "fallbackgate_kv_blocks_read_on_device", "KV blocks read where they live on device", registry=r
        )
        self.fallbacks = Counter(
            "fallbackgate_fallbacks",
            "Objects served with a fallback tag, by class",
            ["request_class", "tag"],
            registry=r,
        )
        self.budget_spent = Counter(
            "fallbackgate_quality_budget_spent_nats",
            "Predicted quality cost of approximate actions taken",
            ["request_class"],
            registry=r,
        )
        self.pool = Gauge("fallbackgate_pool_bytes", "Pool bytes in use", ["pool", "kind"], registry=r)
        self.pool_budget = Gauge("fallbackgate_pool_budget_bytes", "Pool budgets", ["pool"], registry=r)
        self.expert_uses = Counter(
            "fallbackgate_expert_uses", "Expert uses: hit (on device) or miss", ["outcome"], registry=r
        )
        self.expert_hit = Gauge(
            "fallbackgate_expert_hit_ratio", "Expert uses served from device / all uses", registry=r
        )

    def _declare_quality_and_ledger(self, r: CollectorRegistry) -> None:
        """Audited KL and gate failures; the ledger's buffer while it is away."""
        self.audit_kl = Histogram(
            "fallbackgate_audited_kl_nats",
            "Audited KL against the exact baseline",
            ["request_class", "statistic"],
            buckets=KL_BUCKETS,
            registry=r,
        )
        self.gate_failures = Counter(
            "fallbackgate_gate_failures", "Audited requests the gate failed", ["request_class"], registry=r
        )
        self.ledger_buffered = Gauge(
            "fallbackgate_ledger_buffered_bytes", "Measured bytes of records waiting for an absent ledger", registry=r
        )
        self.ledger_buffer = Gauge(
            "fallbackgate_ledger_buffer_bytes", "Records waiting at most before new requests get 503", registry=r
        )
        self.ledger_retrying = Gauge(
            "fallbackgate_ledger_retrying", "1 while ledger writes fail and are retried, else 0", registry=r
        )
        self.ledger_outage = Gauge(
            "fallbackgate_ledger_outage_seconds", "Seconds since the current ledger outage began", registry=r
        )
        self.ledger_retries = Gauge(
            "fallbackgate_ledger_write_retries", "Ledger write attempts after a failure, since start", registry=r
        )

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)

    def on_step(self, result: StepResult, engine: Engine, classes: Mapping[str, str]) -> None:
        """Fold one step's events and the pools' occupancy in (`classes`: request id -> class)."""
        hits = misses = 0
        for e in result.events:
            tier = e.source_tier.value if e.source_tier is not None else "none"
            self.objects.labels(e.tag.value, e.object_kind.value, tier).inc(e.count)
            if e.bytes_moved:
                self.bytes.labels(e.tag.value, e.object_kind.value, tier).inc(e.bytes_moved)
            cls = classes.get(e.request_id, "unknown")
            if e.tag is not Tag.RESIDENT:
                self.fallbacks.labels(cls, e.tag.value).inc(e.count)
            if e.tag.is_approximate and e.predicted_cost:
                self.budget_spent.labels(cls).inc(e.predicted_cost)
            if e.object_kind is ObjectKind.EXPERT:
                if e.tag is Tag.RESIDENT:
                    hits += e.count
                else:
                    misses += e.count
        resident = sum(n for layers in result.expert_resident_uses.values() for n in layers.values())
        if resident:  # resident expert uses are counts on the step, not events
            self.objects.labels(Tag.RESIDENT.value, ObjectKind.EXPERT.value, "none").inc(resident)
            hits += resident
        self.kv_resident.inc(sum(n for layers in result.kv_resident_reads.values() for n in layers.values()))
        self.expert_uses.labels("hit").inc(hits)
        self.expert_uses.labels("miss").inc(misses)
        self._hits, self._misses = self._hits + hits, self._misses + misses
        total = self._hits + self._misses
        if total:
            self.expert_hit.set(self._hits / total)
        for name, pool in (("device", engine.kv_store.device_pool), ("host", engine.kv_store.host_pool)):
            self.pool_budget.labels(name).set(pool.budget_bytes)
            for kind, used in pool.used_bytes_by_kind.items():
                self.pool.labels(name, getattr(kind, "value", str(kind))).set(used)
        self.queue_depth.set(len(engine.scheduler.waiting))
        records = engine.expert_store.reader.quarantine.records()
        self.quarantined.set(len(records))
        for record in records:
            self.quarantined_object.labels(ObjectKind.EXPERT.value, record.object_id).set(1)

    def on_finish(self, output: RequestOutput, slo: Mapping[str, Any] | None, outcome: str) -> None:
        """A finished request: its measured TTFT/TPOT against its class's SLO."""
        cls = output.request_class
        self.requests.labels(cls, outcome).inc()
        self.ttft.labels(cls).observe(output.ttft_s)
        if len(output.output_token_ids) > 1:
            self.tpot.labels(cls).observe(output.tpot_s)
        for name, measured in (("ttft", output.ttft_s), ("tpot", output.tpot_s)):
            target_ms = (slo or {}).get(f"{name}_ms")
            if target_ms is None:
                continue
            is_met = measured * 1000.0 <= target_ms
            self.slo_total.labels(cls, name).inc()
            self.slo_met.labels(cls, name).inc(int(is_met))
            met, checked = self._slo_counts.get((cls, name), (0, 0))
            self._slo_counts[(cls, name)] = (met + int(is_met), checked + 1)
            self.slo_attainment.labels(cls, name).set((met + int(is_met)) / (checked + 1))

    def on_ledger(self, state: BufferState) -> None:
        """The ledger writer's buffer and retries (see :class:`~fallbackgate.ledger.backlog.BufferState`)."""
        self.ledger_buffered.set(state.buffered_bytes)
        self.ledger_buffer.set(state.buffer_bytes)
        self.ledger_retrying.set(int(state.is_retrying))
        self.ledger_outage.set(state.outage_s)
        self.ledger_retries.set(state.num_retries)

    def poll_audits(self, ledger: Ledger, run_id: int) -> None:
        """Observe the audits and verdicts background workers wrote for this run since the last poll (none
        while the ledger does not answer: the next poll picks them up)."""
        with contextlib.suppress(OperationalError, InterfaceError):
            self._poll_audits(ledger, run_id)

    def _poll_audits(self, ledger: Ledger, run_id: int) -> None:
        with self._lock, ledger.engine.connect() as conn:
            stats = conn.execute(
                select(RequestStatRow.request_id, RequestStatRow.mean_kl, RequestStatRow.max_kl, Request.request_class)
                .join(
                    Request,
                    (Request.run_id == RequestStatRow.run_id) & (Request.request_id == RequestStatRow.request_id),
                )
                .where(RequestStatRow.run_id == run_id)
            ).all()
            for row in stats:
                if row.request_id in self._seen_stats:
                    continue
                self._seen_stats.add(row.request_id)
                self.audit_kl.labels(row.request_class, "mean").observe(row.mean_kl)
                self.audit_kl.labels(row.request_class, "max").observe(row.max_kl)
            failed = conn.execute(
                select(VerdictRow.id, Request.request_class)
                .join(Request, (Request.run_id == VerdictRow.run_id) & (Request.request_id == VerdictRow.request_id))
                .where(VerdictRow.run_id == run_id, VerdictRow.passed.is_(False), VerdictRow.id > self._seen_verdicts)
                .order_by(VerdictRow.id)
            ).all()
            for row in failed:
                self._seen_verdicts = max(self._seen_verdicts, row.id)
                self.gate_failures.labels(row.request_class).inc()
