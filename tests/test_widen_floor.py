"""``run_audit.widen_floor``: a request served exact or equivalent only whose KL against the exact baseline goes
beyond what the floor allows — its tolerance on the largest KL, or the allowance quality budgets get on top of
the floor's mean and p99 — has its own exact-vs-exact control folded into the floor (in bf16 an exact request
of 16 decoded together measured mean KL 0.0043 against an allowance of 0.0041 from three control requests and
failed its strict budget); an approximate request never widens it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fallbackgate.audit import run_audit
from fallbackgate.audit.auditor import FloorControl
from fallbackgate.engine.tags import Exactness

CONTROL = {"max_kl": 0.04, "mean_kl": 4e-4, "p99_kl": 3e-3}


def _stats(**kl: float) -> SimpleNamespace:
    return SimpleNamespace(**kl, top1_agreement=1.0)


@pytest.fixture
def control(monkeypatch: pytest.MonkeyPatch) -> FloorControl:
    floor = FloorControl("bfloat16")
    floor.add("control-0", [SimpleNamespace(kl=0.04, max_abs_dlogit=0.1)], _stats(**CONTROL))
    own = _stats(max_kl=0.09, mean_kl=5e-3, p99_kl=0.07)  # the request's own exact-vs-exact control
    monkeypatch.setattr(run_audit, "control_diffs", lambda *args: ([SimpleNamespace(kl=0.09, max_abs_dlogit=0.3)], own))
    return floor


@pytest.mark.parametrize(
    ("served", "kl", "is_folded"),
    [
        (Exactness.EXACT, {"max_kl": 0.09, "mean_kl": 4.3e-3, "p99_kl": 0.02}, True),  # mean beyond 10 x 4e-4
        (Exactness.EXACT, {"max_kl": 0.09, "mean_kl": 1e-3, "p99_kl": 0.07}, True),  # p99 beyond 10 x 3e-3
        (Exactness.EQUIVALENT, {"max_kl": 0.5, "mean_kl": 1e-3, "p99_kl": 0.02}, True),  # beyond the tolerance
        (Exactness.EXACT, {"max_kl": 0.09, "mean_kl": 3e-3, "p99_kl": 0.02}, False),  # within every allowance
        (Exactness.APPROXIMATE, {"max_kl": 9.0, "mean_kl": 1.0, "p99_kl": 5.0}, False),  # its KL is its cost
    ],
)
def test_an_exact_request_beyond_the_floors_allowances_brings_its_own_control(
    control: FloorControl, served: Exactness, kl: dict[str, float], is_folded: bool
) -> None:
    run_audit.widen_floor(None, control, ("r", [1, 2], [3]), served, kl)  # type: ignore[arg-type]
    summary = control.summary()
    assert (summary["request_ids"] == ["control-0", "r"]) is is_folded
    assert summary["mean_kl"] == (5e-3 if is_folded else 4e-4)
