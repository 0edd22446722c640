"""One source per vocabulary: the policy schema's allowed values come from the enums and the controller
registry, and every reader (sweep, dashboard, ledger, gate) takes its names from the same place."""

from __future__ import annotations

from typing import Any

import pytest

from fallbackgate.audit.gate import served_exactness
from fallbackgate.controllers import ControllerKind, controller_class, make_controller, registered_kinds
from fallbackgate.controllers.registry import register_controller
from fallbackgate.dashboard.data import EXACTNESS_NAMES, TAG_ORDER
from fallbackgate.engine.hardware import PROFILES
from fallbackgate.engine.tags import TAG_EXACTNESS, Exactness, Tag
from fallbackgate.ledger.vocabulary import EXACT_TAG_NAMES
from fallbackgate.policy.schema import json_schema
from fallbackgate.profiling import MEASURED, PROFILE_NAMES
from fallbackgate.sweep.grid import CONTROLLERS


def _enum(model: str, field: str) -> list[Any]:
    prop = json_schema()["$defs"][model]["properties"][field]
    return prop.get("items", prop)["enum"]


def test_schema_tags_are_the_non_exact_tags_in_enum_order() -> None:
    non_exact = [t.value for t in Tag if TAG_EXACTNESS[t] is not Exactness.EXACT]
    assert _enum("QualityBudget", "allowed_tags") == non_exact
    assert non_exact == ["cpu_execute", "expert_defer", "expert_lowbit", "kv_dequant", "recompute"]  # user-visible


def test_schema_controllers_are_the_enum_and_the_registry() -> None:
    kinds = [k.value for k in ControllerKind]
    assert _enum("ControllerSpec", "kind") == kinds == [k.value for k in registered_kinds()] == list(CONTROLLERS)
    assert kinds == ["joint", "static_split", "independent_lru", "exact_lru"]  # user-visible


def test_schema_profiles_are_measured_and_the_shipped_what_ifs() -> None:
    assert _enum("HardwareSpec", "profile") == list(PROFILE_NAMES) == [MEASURED, *PROFILES]
    assert list(PROFILE_NAMES) == ["measured", "cpu-box", "pcie4-gpu-nvme"]  # user-visible


def test_the_registry_holds_every_kind_and_builds_its_class() -> None:
    assert set(registered_kinds()) == set(ControllerKind)
    for kind in ControllerKind:
        assert type(make_controller(kind)) is controller_class(kind)
        assert type(make_controller(kind.value)) is controller_class(kind)


def test_a_kind_registers_once() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_controller(ControllerKind.JOINT, lambda cls, policy, o: cls())(controller_class(ControllerKind.JOINT))


def test_readers_above_the_engine_share_its_order() -> None:
    assert EXACTNESS_NAMES == tuple(e.value for e in Exactness)
    ranks = [list(Exactness).index(TAG_EXACTNESS[Tag(t)]) for t in TAG_ORDER]
    assert sorted(TAG_ORDER) == sorted(t.value for t in Tag) and ranks == sorted(ranks)  # exact first
    assert set(EXACT_TAG_NAMES) == {t.value for t in Tag if TAG_EXACTNESS[t] is Exactness.EXACT}


def test_served_exactness_is_the_least_exact_served() -> None:
    assert served_exactness({}) is Exactness.EXACT
    assert served_exactness({"exact": 3, "equivalent": 1}) is Exactness.EQUIVALENT
    assert served_exactness({"exact": 3, "equivalent": 1, "approximate": 1}) is Exactness.APPROXIMATE
    assert served_exactness({"approximate": 0}) is Exactness.EXACT
