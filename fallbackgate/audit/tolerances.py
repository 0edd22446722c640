"""What the gate measures against: the exact-vs-exact control's statistics (:class:`Floor`), the KL each
exactness is allowed above it (:func:`tolerance`, :func:`replay_tolerance`) and the margins they use."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fallbackgate.engine.tags import Exactness

FLOOR_MARGIN = 10.0
TIE_MARGIN = 2.0  # near-tie: exact top-2 gap within this many × the control's largest logit difference
KL_RESOLUTION = {"float32": 1e-10, "float16": 1e-7, "bfloat16": 1e-6}  # smallest floor taken as measured
# float32 leaves equivalent kernels room above a ~1e-14 floor; in 16-bit dtypes the equivalent paths measured
# at the exact paths' own scale (bundled model, bf16, 6 requests × 32 tokens: cpu_execute bitwise equal to
# exact_load, recompute max KL 5e-4 against exact-only up to 1.6e-2 and a floor of 5e-3).
EQUIVALENT_FLOOR_MARGIN = {"float32": 1000.0, "float16": FLOOR_MARGIN, "bfloat16": FLOOR_MARGIN}
EQUIVALENT_TOLERANCE = FLOOR_MARGIN * KL_RESOLUTION["float32"]  # float32 with a zero floor: 1e-9 nats
MAX_TIE_SWAPS = 3  # near-ties a tie-explained request's replay may follow; more are not taken as rounding


@dataclasses.dataclass(frozen=True, slots=True)
class Floor:
    """The exact-vs-exact control's statistics the gate measures against."""

    max_kl: float = 0.0  # largest per-position KL between two exact computations
    mean_kl: float = 0.0  # largest per-request mean KL
    p99_kl: float = 0.0  # largest per-request p99 KL
    max_abs_dlogit: float = 0.0  # largest logit difference: the scale of rounding noise
    dtype: str = "float32"  # the dtype the run computed in

    @classmethod
    def of_run(cls, run: Mapping[str, Any]) -> Floor:
        """From a run row: its ``numeric_floor`` statistics, else its ``numeric_floor_kl`` alone."""
        stats = run.get("numeric_floor") or {}
        fields = {k: stats[k] for k in ("max_kl", "mean_kl", "p99_kl", "max_abs_dlogit", "dtype") if k in stats}
        fields.setdefault("max_kl", run.get("numeric_floor_kl") or 0.0)
        return cls(**fields)


def tolerance(served: Exactness | str, floor: Floor | float | None) -> float:
    """Max KL allowed for a request served with exactness ``served`` (inf for approximate); a bare
    number is a float32 control's max KL."""
    served = Exactness(served)
    if not isinstance(floor, Floor):
        floor = Floor(max_kl=floor or 0.0)
    exact = FLOOR_MARGIN * max(floor.max_kl, KL_RESOLUTION.get(floor.dtype, KL_RESOLUTION["float32"]))
    if served is Exactness.EXACT:
        return exact
    if served is Exactness.EQUIVALENT:
        return max(EQUIVALENT_FLOOR_MARGIN.get(floor.dtype, 1000.0) * floor.max_kl, exact)
    return float("inf")




def replay_tolerance(served: Exactness | str, floor: Floor) -> float:
    """Max KL allowed between served logits and their replay: the exact tolerance when everything served
    was exact, else the equivalent one (the replay runs other kernel shapes than the packed serving)."""
    is_exact = Exactness(served) is Exactness.EXACT
    return tolerance(Exactness.EXACT if is_exact else Exactness.EQUIVALENT, floor)
