"""python -m fallbackgate.bench.victims_oracle [--traces DIR ...] [--slots 20 28 40] [--json FILE]

How close can a victim rule that knows only routing *rates* get to Belady's MIN? On each recorded run's step
walk (a trace's distinct (layer, expert) uses per step, layer by layer: the order the engine loads them), a
demand cache of ``--slots`` experts is simulated with these rules and its loads divided by MIN's:

- ``lru``: least recently used (the probe's simple controller);
- ``frequency``: the lowest decayed routing frequency (ties by key), the joint's order before urgency;
- ``urgency``: the joint controller's own rule and code (:class:`~fallbackgate.controllers.values.ValueModel`
  decayed frequencies, :class:`~fallbackgate.controllers.expert_rank.ExpertRanking` at the layer the walk is
  at): online, it knows only the past;
- ``oracle_rates``: the same urgency with each expert's true share of the run's steps (known in advance: no
  online policy has it);
- ``oracle_window``: the same with each expert's share of the next ``--window`` steps;
- ``oracle_step``: the online urgency, but told which experts the *rest of the step* routes to (a perfect
  next-layers predictor: no such predictor exists, a router applied early is right only part of the time):
  those stay, and if every candidate is needed later in the step, the one needed last goes.

The oracle rows bound what better rate estimates, or a better cross-layer predictor, could give: where they
stay above a goal, only knowing the routing of *later steps* could reach it. Defaults: the traces the
sweep's report keeps.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable

import fallbackgate
from fallbackgate.controllers.expert_rank import ExpertRanking
from fallbackgate.controllers.values import ValueModel
from fallbackgate.engine.hardware import CPU_BOX
from fallbackgate.engine.static_view import StaticView
from fallbackgate.sweep.belady import belady_misses
from fallbackgate.tracing.reader import read_trace

Key = tuple[int, int]  # (layer, expert)
Walk = list[list[Key]]  # per step, the distinct experts it used, in layer order
TRACES = pathlib.Path(fallbackgate.__file__).parent / "sweep_results/report/traces"
EXPERT_BYTES = 1 << 16  # any size: every rule compares experts of one size
RULES = ("lru", "frequency", "urgency", "oracle_rates", "oracle_window", "oracle_step")


def recorded_walk(path: str | pathlib.Path) -> tuple[Walk, int]:
    """A trace's step walk and its decoder layer count."""
    trace = read_trace(str(path))
    used = trace.frame("expert_access").drop_duplicates(["step", "layer", "expert"])
    walk = [
        [(int(layer), int(expert)) for layer, expert in g.sort_values(["layer", "expert"])[["layer", "expert"]].values]
        for _, g in used.groupby("step", sort=True)
    ]
    return walk, int(trace.metadata["model"]["num_layers"])


# (resident experts in recency order, experts this layer of this step needs, layer, step index) -> victim
Victim = Callable[[OrderedDict, set, int, int], Key]


def demand_loads(walk: Walk, num_layers: int, num_slots: int, victim: Victim, after_step=None) -> int:
    """Loads of a cache of `num_slots` experts walking `walk` layer by layer, evicting ``victim(...)``."""
    resident: OrderedDict[Key, None] = OrderedDict()
    loads = 0
    for index, keys in enumerate(walk):
        for layer in range(num_layers):
            pinned = {k for k in keys if k[0] == layer}
            for key in sorted(pinned):
                if key in resident:
                    resident.move_to_end(key)
                    continue
                loads += 1
                if len(resident) >= num_slots:
                    resident.pop(victim(resident, pinned, layer, index))
                resident[key] = None
        if after_step is not None:
            after_step(resident, keys)
    return loads


def _view(resident: list[Key], used: tuple = (), num_layers: int = 1) -> StaticView:
    return StaticView(CPU_BOX, on_device_experts=tuple(sorted(resident)), expert_homes={},
                      bytes_per_expert=EXPERT_BYTES, num_layers=num_layers, used_expert_keys=used)  # fmt: skip


def rule_loads(rule: str, walk: Walk, num_layers: int, num_slots: int, window: int = 8) -> int:
    """Loads of `rule` (one of :data:`RULES`) on `walk`."""
    if rule == "lru":
        return demand_loads(walk, num_layers, num_slots, lambda r, pinned, *_: next(k for k in r if k not in pinned))
    if rule in ("urgency", "frequency", "oracle_step"):
        values, ranking = ValueModel(), ExpertRanking()

        def online(resident: OrderedDict, pinned: set, layer: int, index: int) -> Key:
            view = _view(list(resident), (), num_layers)
            if rule == "frequency":
                return min((k for k in resident if k not in pinned), key=lambda k: (values.expert_value(k, view), k))
            ranking.sync(view, values)
            later = {k for k in walk[index] if k[0] > layer} if rule == "oracle_step" else set()
            needed = []
            for _, key in ranking.victims(view, values, pinned, layer):
                if key not in later:
                    return key
                needed.append(key)
            return max(needed)  # every candidate runs later in this step: the one that runs last

        def learn(resident: OrderedDict, keys: list[Key]) -> None:
            values.update(_view(list(resident), tuple(keys), num_layers))

        return demand_loads(walk, num_layers, num_slots, online, learn)
    whole = Counter(k for keys in walk for k in set(keys))

    def rates(index: int) -> tuple[Counter, int]:
        if rule == "oracle_rates":
            return whole, len(walk)
        ahead = walk[index : index + window]
        return Counter(k for keys in ahead for k in set(keys)), len(ahead)

    def oracle(resident: OrderedDict, pinned: set, layer: int, index: int) -> Key:
        counts, num_steps = rates(index)

        def urgency(key: Key) -> float:  # 1 / expected steps to the next use, as ValueModel.expert_urgency
            p = counts.get(key, 0) / num_steps
            return 0.0 if p <= 0 else 1.0 / ((key[0] - layer) % num_layers / num_layers + 1.0 / p - 1.0)

        return min((k for k in resident if k not in pinned), key=lambda k: (urgency(k), k))

    return demand_loads(walk, num_layers, num_slots, oracle)


def measure(paths: list[pathlib.Path], slots: list[int], window: int) -> list[dict]:
    """One row per trace × slots: MIN's loads and each rule's loads over MIN's."""
    rows = []
    for path in paths:
        walk, num_layers = recorded_walk(path)
        sequence = [k for keys in walk for k in keys]
        for num_slots in slots:
            floor = belady_misses(sequence, num_slots)
            row = {"trace": path.name, "slots": num_slots, "belady_loads": floor}
            row.update({f"{r}_over_belady": rule_loads(r, walk, num_layers, num_slots, window) / floor for r in RULES})
            rows.append(row)
            print(f"{path.name:40s} {num_slots:3d} slots: MIN {floor:4d}  "
                  + "  ".join(f"{r} {row[f'{r}_over_belady']:.3f}" for r in RULES), flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.victims_oracle", description=__doc__.splitlines()[2])
    p.add_argument("--traces", nargs="+", type=pathlib.Path, default=None, help="trace directories (format v1)")
    p.add_argument("--slots", nargs="+", type=int, default=[20, 28, 40], help="expert slots of the cache")
    p.add_argument("--window", type=int, default=8, help="oracle_window's look-ahead in steps")
    p.add_argument("--json", default=None, help="write the rows and their geometric means here")
    args = p.parse_args(argv)
    paths = args.traces or sorted(d for d in TRACES.iterdir() if d.is_dir())
    if any(s < 1 for s in args.slots) or args.window < 1:
        p.error("--slots and --window must be >= 1")
    rows = measure(paths, args.slots, args.window)
    summary = {r: {"geomean": math.prod(x[f"{r}_over_belady"] for x in rows) ** (1 / len(rows)),
                   "max": max(x[f"{r}_over_belady"] for x in rows)} for r in RULES}  # fmt: skip
    for rule, s in summary.items():
        print(f"{rule:14s} over MIN: geometric mean {s['geomean']:.3f}, worst {s['max']:.3f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
