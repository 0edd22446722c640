"""The controller registry: each controller class registers itself for its :class:`ControllerKind` with
:func:`register_controller`; :func:`make_controller` builds one by kind, the sweep lists the registered kinds.

A registration names how a policy and :class:`ControllerOptions` become constructor arguments, so the
registry needs no knowledge of any one controller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fallbackgate.controllers.cost import CostModel
from fallbackgate.engine.controller import Controller
from fallbackgate.policy.schema import ControllerKind, Policy


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ControllerOptions:
    """What a controller is built from besides the policy (each controller takes the ones it needs)."""

    cost_model: CostModel | None  # the joint controller's quality-cost predictor (None: the default scales)
    top_k: int  # the model's experts per token
    expert_fraction: float  # static split: device share of expert slots
    is_equivalent_allowed: bool  # baselines may serve a late miss with the equivalent tags joint may use


Build = Callable[[type[Controller], Policy, ControllerOptions], Controller]
"""(controller class, policy, options) -> a controller."""

_REGISTRY: dict[ControllerKind, tuple[type[Controller], Build]] = {}


def register_controller(kind: ControllerKind, build: Build) -> Callable[[type[Controller]], type[Controller]]:
    """Class decorator: register the class as the controller of `kind`, built by `build`."""

    def register(cls: type[Controller]) -> type[Controller]:
        if kind in _REGISTRY:
            raise ValueError(f"controller kind {kind.value!r} is already registered ({_REGISTRY[kind][0].__name__})")
        _REGISTRY[kind] = (cls, build)
        return cls

    return register


def registered_kinds() -> tuple[ControllerKind, ...]:
    """The registered controller kinds, in :class:`ControllerKind` order."""
    return tuple(k for k in ControllerKind if k in _REGISTRY)


def _registration(kind: ControllerKind | str) -> tuple[type[Controller], Build]:
    kind = ControllerKind(kind)
    if kind not in _REGISTRY:
        raise KeyError(f"no controller registered for {kind.value!r} (registered: {[k.value for k in _REGISTRY]})")
    return _REGISTRY[kind]


def controller_class(kind: ControllerKind | str) -> type[Controller]:
    """The class registered for `kind` (a KeyError naming the registered kinds when there is none)."""
    return _registration(kind)[0]


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
    cls, build = _registration(kind)
    policy = policy or Policy()
    options = ControllerOptions(
        cost_model=cost_model,
        top_k=top_k,
        expert_fraction=expert_fraction if expert_fraction is not None else policy.controller.expert_fraction,
        is_equivalent_allowed=is_equivalent_allowed,
    )
    return build(cls, policy, options)
