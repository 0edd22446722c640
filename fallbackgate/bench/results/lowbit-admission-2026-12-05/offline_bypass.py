"""python fallbackgate/bench/results/lowbit-admission-2026-12-05/offline_bypass.py [LOWBIT_FRACTION]

Offline, on the report's ten traces (victims_oracle's step walks, fixed slots): the joint's urgency victims,
and with a miss colder than its first victim (its urgency at its layer × `margin` below the victim's) served
from a low-bit copy of LOWBIT_FRACTION of the expert's bytes instead of loaded (no room taken). Prints
(exact loads + fraction × low-bit serves) over Belady's MIN loads, and the share of uses served low-bit.
The bundled model's int8 copy is 92,160 of 294,912 bytes: 0.3125.
"""

import math
import sys
from collections import OrderedDict

from fallbackgate.bench import victims_oracle as vo
from fallbackgate.controllers.expert_rank import ExpertRanking
from fallbackgate.controllers.values import ValueModel
from fallbackgate.sweep.belady import belady_misses

LOWBIT_FRACTION = float(sys.argv[1]) if len(sys.argv) > 1 else 0.3125


def walk_cache(walk: vo.Walk, num_layers: int, num_slots: int, margin: float | None) -> tuple[int, int, int]:
    """(exact loads, low-bit serves, uses) of the urgency cache, bypassing colder misses when `margin` is set."""
    values, ranking = ValueModel(), ExpertRanking()
    resident: OrderedDict = OrderedDict()
    loads = bypasses = uses = 0
    for keys in walk:
        for layer in range(num_layers):
            pinned = {k for k in keys if k[0] == layer}
            for key in sorted(pinned):
                uses += 1
                if key in resident:
                    resident.move_to_end(key)
                    continue
                if len(resident) >= num_slots:
                    view = vo._view(list(resident), (), num_layers)
                    ranking.sync(view, values)
                    victim = next(k for _, k in ranking.victims(view, values, pinned, layer))
                    urgency = values.expert_urgency
                    if margin is not None and urgency(key, view, layer) * margin < urgency(victim, view, layer):
                        bypasses += 1
                        continue
                    resident.pop(victim)
                loads += 1
                resident[key] = None
        values.update(vo._view(list(resident), tuple(keys), num_layers))
    return loads, bypasses, uses


def main() -> None:
    walks = [vo.recorded_walk(p) for p in sorted(d for d in vo.TRACES.iterdir() if d.is_dir())]
    for num_slots in (20, 28, 40):
        for margin in (None, 1.0, 0.5, 0.25):
            ratios, shares = [], []
            for walk, num_layers in walks:
                floor = belady_misses([k for keys in walk for k in keys], num_slots)
                loads, bypasses, uses = walk_cache(walk, num_layers, num_slots, margin)
                ratios.append((loads + LOWBIT_FRACTION * bypasses) / floor)
                shares.append(bypasses / uses)
            geomean = math.prod(ratios) ** (1 / len(ratios))
            share = sum(shares) / len(shares)
            print(f"slots {num_slots} margin {margin}: bytes/MIN geomean {geomean:.3f} worst {max(ratios):.3f}; "
                  f"low-bit share of uses mean {share:.3f} max {max(shares):.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
