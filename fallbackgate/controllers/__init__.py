"""Controllers behind the engine's one interface (:class:`fallbackgate.engine.controller.Controller`),
each registered for its :class:`ControllerKind` (:mod:`fallbackgate.controllers.registry`)."""

from __future__ import annotations

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.controllers.independent_lru import IndependentLRUController
from fallbackgate.controllers.joint import JointController, Slip
from fallbackgate.controllers.registry import controller_class, make_controller, registered_kinds
from fallbackgate.controllers.static_split import StaticSplitController
from fallbackgate.policy.schema import ControllerKind

__all__ = [
    "ControllerKind",
    "ExactLRUController",
    "IndependentLRUController",
    "JointController",
    "Slip",
    "StaticSplitController",
    "controller_class",
    "make_controller",
    "registered_kinds",
]
