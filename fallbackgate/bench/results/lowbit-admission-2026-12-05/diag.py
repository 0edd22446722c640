"""python fallbackgate/bench/results/lowbit-admission-2026-12-05/diag.py sweep ... --expert-admission lowbit_colder

Runs ``fallbackgate sweep`` (the patch beside this file applied) counting, for the joint's in-time expert misses,
why the low-bit admission did or did not serve them, and every expert decision by tag and reason.
"device room" counts room left after the layer's exact loads decided before the miss; diag.txt was written by
the first version of this script, which counted ``miss.is_device_room`` alone (room for one expert, before any
of the layer's loads) as "device room"; diag-booked-room.txt by this one.
"""

import collections
import runpy
import sys

from fallbackgate.controllers import joint

COUNTS: collections.Counter = collections.Counter()
_expert_action = joint.JointController.expert_action
_lowbit_when_colder = joint.JointController._lowbit_when_colder


def expert_action(self, miss):  # noqa: ANN001, ANN201
    decision = _expert_action(self, miss)
    COUNTS[f"decision {decision.tag.value} {decision.reason[:30]}"] += 1
    return decision


def lowbit_when_colder(self, miss, budget):  # noqa: ANN001, ANN201
    COUNTS["asked"] += 1
    if not miss.is_lowbit_available:
        COUNTS["no lowbit copy"] += 1
    elif (
        miss.is_device_room
        and self.view.device_free_bytes
        >= (sum(1 for k in self.loading if k[0] == miss.layer) + 1) * self.view.bytes_per_expert
    ):  # room even after the layer's loads decided before this miss
        COUNTS["device room"] += 1
    elif miss.is_device_room:
        COUNTS["room only before the layer's booked loads"] += 1
    elif not self.is_colder_than_victim(miss, self.view):
        COUNTS["not colder"] += 1
    else:
        why = budget.why_not(
            joint.Tag.EXPERT_LOWBIT, self.cost.expert_cost(joint.Tag.EXPERT_LOWBIT, miss.layer, miss.max_gate_weight)
        )
        if why:
            COUNTS[f"{miss.request_class}: " + why.split("(")[0]] += 1
    return _lowbit_when_colder(self, miss, budget)


joint.JointController.expert_action = expert_action
joint.JointController._lowbit_when_colder = lowbit_when_colder
sys.argv = ["fallbackgate", *sys.argv[1:]]
try:  # as `python -m fallbackgate ...` would run
    runpy.run_module("fallbackgate", run_name="__main__", alter_sys=True)
finally:
    for name, count in sorted(COUNTS.items(), key=lambda kv: -kv[1]):
        print(f"{count:6d} {name}")
