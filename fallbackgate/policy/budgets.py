"""Per-request quality budget accounting: predicted spend against the class's limits.

The controller spends predicted nats (from :mod:`fallbackgate.controllers.cost`) as it chooses approximate
actions. A request may take an action only while, after it,

- its cumulative spend stays within ``max_mean_kl`` × the positions it has produced (this step's included),
  so the predicted mean KL per position never exceeds the limit at any point of the request;
- its spend in the current step stays within ``P99_HEADROOM`` × ``max_p99_kl`` (one position's predicted
  KL; the cost proxies are fitted to means, so the tail keeps headroom);
- the positions it touches with any approximate action stay within ``1 − min_top1_agreement`` of its
  positions (only a touched position can flip its top-1 token, so top-1 agreement is protected);
- its approximate objects stay within ``max_approx_fraction`` of a lower bound on the objects served;
- the tag is in the class's ``allowed_tags``.
"""

from __future__ import annotations

import dataclasses

from fallbackgate.engine.tags import Tag
from fallbackgate.policy.schema import QualityBudget

EPS = 1e-12
P99_HEADROOM = 0.5  # share of max_p99_kl one position may be predicted to cost


@dataclasses.dataclass
class RequestBudget:
    """One request's limits and what it has spent so far."""

    request_id: str
    request_class: str
    limits: QualityBudget
    spent: float = 0.0  # predicted nats, summed over all actions
    positions: int = 0  # generated positions the spend averages over (this step's included)
    step_id: int = -1
    step_spent: float = 0.0
    approx_objects: int = 0
    closed_objects: int = 0  # objects of finished steps (a lower bound)
    step_base: int = 0  # expert uses this step is sure to have (expert layers × top_k)
    step_experts: int = 0  # expert misses decided this step
    step_kv: int = 0  # KV block misses decided this step
    touched_positions: int = 0  # positions (steps) with at least one approximate action
    is_step_touched: bool = False

    def begin_step(self, step_id: int, emits_position: bool, base_objects: int) -> None:
        """Open a step: count its guaranteed objects and, when it produces a token, one more position."""
        if step_id == self.step_id:
            return
        self.closed_objects = self.total_objects
        self.step_id, self.step_spent = step_id, 0.0
        self.step_base, self.step_experts, self.step_kv = base_objects, 0, 0
        self.is_step_touched = False
        self.positions += 1 if emits_position or self.positions == 0 else 0

    @property
    def total_objects(self) -> int:
        """A lower bound on the objects (expert uses and off-device KV reads) served to this request."""
        return self.closed_objects + max(self.step_base, self.step_experts) + self.step_kv

    def allows(self, tag: Tag) -> bool:
        """Whether the class permits `tag` at all (exact tags always)."""
        return tag in (Tag.RESIDENT, Tag.EXACT_LOAD) or tag.value in self.limits.allowed_tags

    def remaining(self) -> float:
        """Predicted nats this request may still spend in the current step."""
        total = self.limits.max_mean_kl * max(self.positions, 1) - self.spent
        return max(0.0, min(total, P99_HEADROOM * self.limits.max_p99_kl - self.step_spent))

    def may_touch_step(self) -> bool:
        """Whether one more position may carry an approximate action under ``min_top1_agreement``."""
        if self.is_step_touched:
            return True
        allowed = (1.0 - self.limits.min_top1_agreement) * max(self.positions, 1)
        return self.touched_positions + 1 <= allowed + EPS

    def fits(self, tag: Tag, cost: float) -> bool:
        """Whether taking `tag` at predicted `cost` keeps every limit."""
        return not self.why_not(tag, cost)

    def why_not(self, tag: Tag, cost: float) -> str:
        """The first limit taking `tag` at predicted `cost` would break ("" when it keeps every one)."""
        if not self.allows(tag):
            return "not allowed for the class"
        if not tag.is_approximate:
            return ""
        if cost > self.remaining() + EPS:
            return f"over the quality budget ({cost:.3g} nats predicted, {self.remaining():.3g} left)"
        if not self.may_touch_step():
            return "min_top1_agreement: no more positions may carry an approximate action"
        if self.approx_objects + 1 > self.limits.max_approx_fraction * self.total_objects + EPS:
            return f"max_approx_fraction {self.limits.max_approx_fraction:g} reached"
        return ""

    def spend(self, tag: Tag, cost: float, is_expert: bool) -> None:
        """Record an action taken for this request (call `fits` first for approximate tags)."""
        if is_expert:
            self.step_experts += 1
        else:
            self.step_kv += 1
        if tag.is_approximate:
            if not self.is_step_touched:
                self.touched_positions += 1
                self.is_step_touched = True
            self.approx_objects += 1
            self.spent += cost
            self.step_spent += cost

    @property
    def is_spent(self) -> bool:
        """True when nothing approximate fits any more (exact actions only from here)."""
        return self.remaining() <= EPS or self.limits.max_approx_fraction == 0

    @property
    def predicted_mean_kl(self) -> float:
        return self.spent / max(self.positions, 1)


class BudgetBook:
    """Budgets of all live requests, created on first sight from their class."""

    def __init__(self, classes: dict[str, QualityBudget], default: QualityBudget | None = None) -> None:
        self.classes, self.default = classes, default or QualityBudget()
        self.requests: dict[str, RequestBudget] = {}

    def get(self, request_id: str, request_class: str) -> RequestBudget:
        """The budget of `request_id`, created from its class (exact-only when the class is unknown)."""
        budget = self.requests.get(request_id)
        if budget is None:
            limits = self.classes.get(request_class, self.default)
            budget = self.requests[request_id] = RequestBudget(request_id, request_class, limits)
        return budget

    def forget_except(self, live_ids: set[str]) -> None:
        """Drop finished requests (keeps memory flat over long runs)."""
        for request_id in [r for r in self.requests if r not in live_ids]:
            del self.requests[request_id]
