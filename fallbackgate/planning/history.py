"""Routing concentration of a model, fitted from its recorded runs.

Uniform routing puts an expert on device with probability f = slots / experts. Trained (and random-weight)
routers concentrate on fewer experts, so an LRU device cache hits more often: a recorded run at slot
fraction f that measured a step-start hit rate h gives the exponent of h = f^alpha (alpha < 1: more
concentrated than uniform). The plan uses the mean exponent of the model's recorded runs, if any.
"""

from __future__ import annotations

import math
import pathlib
import statistics

from sqlalchemy import func, select

from fallbackgate.engine.messages import StepKind
from fallbackgate.engine.tags import ObjectKind, Tag
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.models import EventRow, Run, Step, StepRequest
from fallbackgate.ledger.object_uses import object_uses
from fallbackgate.planning.shape import ModelShape


def step_start_hit(use_hit: float, unique: float, picks: float) -> float:
    """The fraction of experts on device when a step starts, from the measured hit rate per use (later
    uses of an expert loaded earlier in the step hit too): inverse of 1 - unique (1 - h) / picks."""
    return 1.0 - (1.0 - use_hit) * picks / unique


def routing_exponent(ledger: Ledger, shape: ModelShape, exclude_run_ids: set[int] = frozenset()) -> float | None:
    """Mean alpha over the model's recorded runs with a device budget (None when there are none)."""
    alphas = []
    with ledger.engine.connect() as conn:
        runs = conn.execute(select(Run.id, Run.model_path, Run.memory).where(Run.memory.is_not(None))).all()
        for run in runs:
            memory = run.memory or {}
            if run.id in exclude_run_ids or pathlib.Path(str(run.model_path)).name != shape.name:
                continue
            total = memory.get("expert_bytes_total") or 0
            peak = (memory.get("peak_device_pool_bytes_by_kind") or {}).get(ObjectKind.EXPERT.value, 0)
            fraction = peak / total if total else 1.0
            u = object_uses(
                (EventRow.run_id == run.id) & (EventRow.object_kind == ObjectKind.EXPERT.value),
                StepRequest.run_id == run.id,
            )
            uses = dict(conn.execute(select(u.c.tag, func.sum(u.c.count)).group_by(u.c.tag)).all())
            batch = conn.execute(
                select(func.avg(Step.num_requests)).where(Step.run_id == run.id, Step.kind == StepKind.DECODE.value)
            ).scalar()
            num_uses = sum(int(n) for n in uses.values())
            if not num_uses or not batch or not 0.0 < fraction < 1.0:
                continue
            picks = float(batch) * shape.top_k
            unique = shape.num_experts * (1.0 - (1.0 - min(1.0, shape.top_k / shape.num_experts)) ** float(batch))
            hit = step_start_hit(int(uses.get(Tag.RESIDENT.value, 0)) / num_uses, unique, picks)
            if 0.0 < hit < 1.0:
                alphas.append(math.log(hit) / math.log(fraction))
    return statistics.mean(alphas) if alphas else None
