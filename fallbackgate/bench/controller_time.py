"""python -m fallbackgate.bench.controller_time --slo-from SWEEP_JSON [--workloads multi-turn,mixed] [--seeds 40,41]
       [--ram-frac 0.25] [--controllers static_split,independent_lru,joint] [--kv-share 0.3] [--json FILE]

Where the controllers' own time goes in real sweep cells: each run is the sweep's (`fallbackgate.sweep.regime`:
recorded, audited, gated, traced, against the SLO targets of the sweep given by --slo-from), with wall clock
(``perf_counter``) around every call of the controller's step hooks and miss decisions and of the executor's
room making (``make_room``: the victim walk it asks the controller for, and the evictions and spills it
makes). Per controller: steps, calls and microseconds per call of each, and milliseconds per step of all of
them together; the controllers' runs are interleaved seed by seed. JSON out. Stop 47 measured the joint
controller's per-step time with it, before and after its room making was asked once per layer.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from fallbackgate.controllers import ControllerKind
from fallbackgate.controllers.registry import controller_class
from fallbackgate.engine.experts.executor import Executor
from fallbackgate.ledger.db import open_ledger
from fallbackgate.sweep.regime import STATIC, RegimeConfig, run_regime
from fallbackgate.tinymoe import CHECKPOINT_DIR

HOOKS = ("on_step_start", "on_step_end", "expert_action", "kv_action")  # the controller calls timed
Totals = dict[str, list[float]]  # call name -> [calls, seconds]


@contextlib.contextmanager
def timed(cls: type, names: tuple[str, ...], totals: Totals) -> Iterator[None]:
    """While open, every call of `cls`'s methods `names` (as the class resolves them) adds to `totals`."""
    originals = {name: cls.__dict__.get(name) for name in names}

    def wrapper(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                total = totals[name]
                total[0] += 1
                total[1] += time.perf_counter() - started

        return call

    for name in names:
        setattr(cls, name, wrapper(name, getattr(cls, name)))
    try:
        yield
    finally:
        for name, original in originals.items():
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)


def measure(cfg: RegimeConfig, ledger_url: str) -> dict[str, Any]:
    """Run `cfg` (one controller) with its calls timed: steps, and calls and seconds per call name."""
    totals: Totals = collections.defaultdict(lambda: [0, 0.0])
    cls = controller_class(cfg.controllers[0])
    with timed(cls, HOOKS, totals), timed(Executor, ("make_room",), totals):
        result = run_regime(cfg, open_ledger(ledger_url), log=lambda line: None)
    return {
        "num_steps": int(totals["on_step_end"][0]),
        "calls": {name: {"calls": int(n), "seconds": s} for name, (n, s) in totals.items()},
        "runs": [{k: p[k] for k in ("workload", "seed", "ram_frac", "run_id")} for p in result["points"]],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m fallbackgate.bench.controller_time", description=__doc__.splitlines()[3]
    )
    p.add_argument("--slo-from", type=pathlib.Path, required=True, help="sweep.json whose SLO targets the runs use")
    p.add_argument("--workloads", default="multi-turn,mixed")
    p.add_argument("--seeds", default="40,41")
    p.add_argument("--ram-frac", type=float, default=0.25)
    p.add_argument("--controllers", default="static_split,independent_lru,joint")
    p.add_argument("--kv-share", type=float, default=0.3, help="static_split's KV share")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    workloads = tuple(args.workloads.split(","))
    references = json.loads(args.slo_from.read_text())["slo_references"]
    missing = [w for w in workloads if w not in references]
    if missing:
        sys.exit(f"controller_time: {args.slo_from} has no SLO reference for {missing}")
    kinds = [ControllerKind(k).value for k in args.controllers.split(",")]
    out: dict[str, Any] = {"command": " ".join(sys.argv), "controllers": {}}
    with tempfile.TemporaryDirectory(prefix="fg-controller-time-") as scratch:
        ledger_url = f"sqlite:///{scratch}/ledger.sqlite"
        for seed in (int(s) for s in args.seeds.split(",")):
            for kind in kinds:
                cfg = RegimeConfig(
                    model_dir=str(CHECKPOINT_DIR), workloads=workloads, seeds=(seed,), ram_fracs=(args.ram_frac,),
                    kv_shares=(args.kv_share,), controllers=(kind,), slo_from={w: references[w] for w in workloads},
                    lowbit_dir=f"{scratch}/lowbit",
                )  # fmt: skip
                _add(out["controllers"].setdefault(kind, {}), measure(cfg, ledger_url))
    for kind, row in out["controllers"].items():
        row["ms_per_step"] = 1e3 * sum(c["seconds"] for c in row["calls"].values()) / max(1, row["num_steps"])
        label = kind if kind != STATIC else f"{kind} (KV {args.kv_share:g})"
        print(f"{label:28s} {row['num_steps']:5d} steps  {row['ms_per_step']:.3f} ms per step in these calls")
        for name, call in sorted(row["calls"].items()):
            call["us_per_call"] = 1e6 * call["seconds"] / max(1, call["calls"])
            print(f"    {name:14s} {call['calls']:6d} calls  {call['us_per_call']:7.1f} us per call")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


def _add(row: dict[str, Any], part: dict[str, Any]) -> None:
    """Fold one seed's measure into the controller's row (steps, calls and seconds summed)."""
    row["num_steps"] = row.get("num_steps", 0) + part["num_steps"]
    calls = row.setdefault("calls", {})
    for name, call in part["calls"].items():
        mine = calls.setdefault(name, {"calls": 0, "seconds": 0.0})
        mine["calls"] += call["calls"]
        mine["seconds"] += call["seconds"]
    row.setdefault("runs", []).extend(part["runs"])


if __name__ == "__main__":
    main()
