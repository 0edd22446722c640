"""Controllers behind the engine's one interface (:class:`fallbackgate.engine.controller.Controller`),
chosen by an enum."""

from __future__ import annotations

import enum

from fallbackgate.controllers.cost import CostModel
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.controllers.independent_lru import IndependentLRUController
from fallbackgate.controllers.joint import JointController, Slip
from fallbackgate.controllers.static_split import StaticSplitController
from fallbackgate.engine.controller import Controller
from fallbackgate.policy.schema import Policy


class ControllerKind(str, enum.Enum):
    """The controllers a policy may name."""

    JOINT = "joint"  # one device budget, link-time scheduling, budgeted fallbacks
    STATIC_SPLIT = "static_split"  # fixed expert / KV shares, LRU in each, exact only
    INDEPENDENT_LRU = "independent_lru"  # two LRU caches competing for one budget, exact only
    EXACT_LRU = "exact_lru"  # mixtral-offloading style: experts evicted first, exact only


def make_controller(
    kind: ControllerKind | str,
    policy: Policy | None = None,
    *,
    cost_model: CostModel | None = None,
    top_k: int = 1,
    expert_fraction: float | None = None,
    is_equivalent_allowed: bool = False,
) -> Controller:
    """Build the controller `kind` for `policy` (a default policy when None).

    `top_k` is the model's experts per token (the joint controller's lower bound on objects per step);
    `expert_fraction` overrides the policy's static split share; `is_equivalent_allowed` lets the static
    split and independent LRU baselines serve a late miss with the equivalent tags joint may use.
    """
    kind = ControllerKind(kind)
    policy = policy or Policy()
    if kind is ControllerKind.JOINT:
        return JointController(policy, cost_model, top_k=top_k)
    if kind is ControllerKind.STATIC_SPLIT:
        fraction = expert_fraction if expert_fraction is not None else policy.controller.expert_fraction
        return StaticSplitController(fraction, policy, is_equivalent_allowed)
    if kind is ControllerKind.INDEPENDENT_LRU:
        return IndependentLRUController(policy, is_equivalent_allowed)
    return ExactLRUController(kv_quant_bits=policy.controller.kv_quant_bits)


__all__ = [
    "ControllerKind",
    "ExactLRUController",
    "IndependentLRUController",
    "JointController",
    "Slip",
    "StaticSplitController",
    "make_controller",
]
