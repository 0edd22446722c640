"""The run row of :func:`fallbackgate.recording.record_and_judge` names the engine's controller by the kind its
class is registered for, whatever engine it is given."""

from __future__ import annotations

from fallbackgate.controllers import ExactLRUController, make_controller, registered_kinds
from fallbackgate.policy.schema import ControllerKind
from fallbackgate.recording.record import controller_kind
from fallbackgate.sweep.belady import TraceRecorder


def test_every_registered_controller_is_named_by_its_kind() -> None:
    kinds = registered_kinds()
    assert set(kinds) == set(ControllerKind)
    assert [controller_kind(make_controller(kind)) for kind in kinds] == [kind.value for kind in kinds]
    assert controller_kind(ExactLRUController(["expert_lowbit"])) == "exact_lru"


def test_an_unregistered_controller_is_named_by_its_class() -> None:
    class Probe(ExactLRUController):
        pass

    assert controller_kind(Probe()) == "Probe"  # a subclass is not the registered class
    assert controller_kind(TraceRecorder(ExactLRUController())) == "TraceRecorder"
