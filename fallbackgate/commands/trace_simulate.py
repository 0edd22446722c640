"""``fallbackgate trace simulate TRACE --out FILE.json [--controllers A,B] [--budget-gib X,Y] [--expert-fractions F,G]
[--devices all|measured,...] [--compress E:KV,...] [--jobs N]``: the project's controllers over the trace without
the model, every configuration of the grid in parallel processes (``--compress``: what-if experts and KV blocks at
those fractions of their recorded bytes); one JSON object per configuration (hits, misses and bytes
by tag, stall, P99 TPOT, SLO attainment). ``--io real DIR [--io-depth N] [--no-pace] [--io-order O]
[--io-queues Q] [--io-workers N]`` performs each
configuration's transfers against a scratch file in DIR instead (one configuration after another);
``--progress`` draws a bar.

``fallbackgate trace validate TRACE [--calibrate-from TRACE] [--device waits|profile|...] [--io real DIR]
[--expert-fraction F] [--target TRACE2] [--json FILE]``: simulate a recorded run with its own controller and
budget and compare stall and TPOT with what it measured; exit 1 when outside max(25 %, 1 ms per step).
``--expert-fraction`` gives a static split's expert share where the trace predates ``metadata.json`` keeping
it; ``--target`` predicts another run of the same requests (its controller, budget and split over TRACE's
accesses, against what it measured).

Exit status: 0 on success (validate: 1 outside the bound), 2 for bad input (an unreadable trace, a bad flag).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

from fallbackgate.commands.checks import check_output_path, comma_separated
from fallbackgate.controllers.registry import registered_kinds
from fallbackgate.tracing.devices import simulation_devices
from fallbackgate.tracing.reader import Trace, read_trace
from fallbackgate.tracing.realio import ORDERS, QUEUES, RealIO, simulate_real
from fallbackgate.tracing.simulate import MAX_KV_BYTES_SCALE, SimulationConfig
from fallbackgate.tracing.simulate_run import simulate_many
from fallbackgate.tracing.simulator import GIB
from fallbackgate.tracing.validate import recorded_budget, validate
from fallbackgate.tracing.writer import TraceFormatError


def add_simulate_parsers(sub: Any) -> None:
    """Register ``trace simulate`` and ``trace validate`` under ``trace``'s subparsers."""
    m = sub.add_parser("simulate", help="the project's controllers over a trace, without the model")
    m.add_argument("trace", metavar="TRACE", help="a trace directory (format v1)")
    m.add_argument("--out", metavar="FILE.json", required=True, help="results, one object per configuration")
    m.add_argument("--controllers", type=_names, default=None, help="comma-separated kinds (default: all registered)")
    m.add_argument("--budget-gib", type=_floats, default=None, help="device budgets (default: the recorded total)")
    m.add_argument(
        "--expert-fractions", type=_floats, default=(), help="static split's expert shares (default: policy)"
    )
    m.add_argument("--devices", type=_names, default=("all",), help="device models by name prefix (default: all)")
    m.add_argument("--compress", type=_scales, default=((1.0, 1.0),), metavar="E:KV,...",
                   help="what-if compression: experts and KV blocks at these fractions of their recorded bytes, "
                        "e.g. 1:1,0.5:1,0.5:0.5 (default 1:1); a KV factor above 1 is a larger KV")  # fmt: skip
    m.add_argument("--jobs", type=int, default=None, help="processes (default: the CPUs)")
    _add_io_flags(m)
    m.add_argument("--progress", action="store_true", help="a progress bar on stderr")
    m.set_defaults(func=run_simulate)
    v = sub.add_parser("validate", help="simulate a recorded run with its own configuration; compare")
    v.add_argument("trace", metavar="TRACE", help="a trace recorded by `run --trace` or `serve --trace`")
    v.add_argument("--calibrate-from", metavar="TRACE", default=None, help="fit the waits on another run (held out)")
    v.add_argument("--device", default="waits", help="waits (default), profile, or a what-if's name prefix")
    v.add_argument("--target", metavar="TRACE", default=None,
                   help="predict this other recorded run of the same requests: its controller, budget and split "
                        "simulated over TRACE's accesses, against what it measured")  # fmt: skip
    v.add_argument("--expert-fraction", type=float, default=None,
                   help="a static split's expert share, for traces recorded before metadata.json kept it")  # fmt: skip
    v.add_argument("--json", metavar="FILE", default=None, help="write the comparison as JSON")
    _add_io_flags(v)
    v.set_defaults(func=run_validate)


def _add_io_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--io", nargs=2, metavar=("real", "DIR"), default=None,
                        help="perform the I/O against a scratch file in DIR (a disk; tmpfs for RAM) instead of "
                        "pricing it on a device model")  # fmt: skip
    parser.add_argument("--io-depth", type=int, default=1, help="--io real: demand reads in flight per layer")
    parser.add_argument("--no-pace", action="store_true", help="--io real: do not sleep each step's compute time")
    parser.add_argument("--io-order", choices=ORDERS, default="priority",
                        help="--io real: demand reads before queued prefetches and spill writes (priority, the "
                        "engine's order) or in submission order (fifo)")  # fmt: skip
    parser.add_argument("--io-queues", choices=QUEUES, default="shared",
                        help="--io real: one queue for experts and KV (shared) or one per kind (by_kind, half the "
                        "workers each)")  # fmt: skip
    parser.add_argument("--io-workers", type=int, default=None,
                        help="--io real: transfers in flight in all (default: --io-depth)")  # fmt: skip


def real_io(args: argparse.Namespace) -> RealIO | None:
    """The ``--io real DIR`` settings (None without ``--io``); ValueError for a bad mode or directory."""
    if args.io is None:
        return None
    mode, directory = args.io
    if mode != "real":
        raise ValueError(f"--io takes `real DIR`, got {mode!r}")
    if not pathlib.Path(directory).is_dir():
        raise ValueError(f"--io real {directory}: not a directory")
    if args.io_depth < 1:
        raise ValueError(f"--io-depth must be >= 1, got {args.io_depth}")
    return RealIO(
        directory, args.io_depth, not args.no_pace, order=args.io_order, queues=args.io_queues, workers=args.io_workers
    )


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


_floats = comma_separated(float, "numbers", lambda v: v > 0, "numbers must be > 0")


def _scales(text: str) -> tuple[tuple[float, float], ...]:
    try:
        pairs = tuple((float(e), float(k)) for e, k in (x.split(":") for x in text.split(",") if x.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated EXPERTS:KV fractions, got {text!r}") from None
    if not pairs or any(not (0 < e <= 1 and 0 < k <= MAX_KV_BYTES_SCALE) for e, k in pairs):
        raise argparse.ArgumentTypeError(
            f"fractions must be in (0, 1] (KV: (0, {MAX_KV_BYTES_SCALE:g}], above 1 a larger KV), got {text!r}"
        )
    return pairs


def simulation_configs(args: argparse.Namespace, trace: Trace) -> list[SimulationConfig]:
    """The grid: controllers × budgets × devices (× expert fractions for the static split)."""
    kinds = args.controllers or tuple(k.value for k in registered_kinds())
    unknown = sorted(set(kinds) - {k.value for k in registered_kinds()})
    if unknown:
        raise ValueError(f"unknown controller(s) {unknown}; registered: {[k.value for k in registered_kinds()]}")
    devices = simulation_devices(trace)
    if "all" not in args.devices:
        devices = [d for d in devices if any(d.name.startswith(n) for n in args.devices)]
    if not devices:
        raise ValueError(
            f"no device model matches {list(args.devices)}; known: {[d.name for d in simulation_devices(trace)]}"
        )
    recorded = recorded_budget(trace)
    if not args.budget_gib and not recorded:
        raise ValueError("the trace records no budgets: give --budget-gib")
    sizes = [int(g * GIB) for g in args.budget_gib] if args.budget_gib else [int(recorded)]
    configs = []
    for kind in kinds:
        fractions = args.expert_fractions if kind == "static_split" and args.expert_fractions else (None,)
        for size in sizes:
            for device in devices:
                configs += [SimulationConfig(kind, size, device, f, e, k) for f in fractions
                            for e, k in args.compress]  # fmt: skip
    return configs


def run_simulate(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate trace simulate``."""
    try:
        check_output_path(args.out, "--out")
        trace = read_trace(args.trace)
        configs = simulation_configs(args, trace)
        real = real_io(args)  # refused before any configuration runs
    except (ValueError, TraceFormatError) as exc:
        print(f"fallbackgate trace simulate: error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    if real is not None:
        results = simulate_real(args.trace, configs, real)
    else:
        results = simulate_many(args.trace, configs, args.jobs, progress=args.progress)
    elapsed = time.perf_counter() - started
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    for r in results:
        head = f"{r['controller']:16s} {r['budget_gib']:7.3f} GiB {r['device']:24s} f={r['expert_fraction']}"
        if (r["expert_bytes_scale"], r["kv_bytes_scale"]) != (1.0, 1.0):
            head += f" compress {r['expert_bytes_scale']:g}:{r['kv_bytes_scale']:g}"
        tail = (
            r.get("error")
            or f"stall {r['stall_s']:.3f} s  p99 TPOT {r['p99_tpot_ms']:.2f} ms  SLO {r['slo_attainment']:.2f}"
        )
        if r.get("num_unfit_gathers"):
            tail += f"  UNSERVABLE: {r['num_unfit_gathers']} layer gathers did not fit the budget"
        print(f"{head}  {tail}")
    print(f"{len(configs)} configurations in {elapsed:.1f} s; wrote {args.out}")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate trace validate``: 0 within the bound, 1 outside it, 2 for bad input."""
    try:
        if args.json:
            check_output_path(args.json, "--json")
        real = real_io(args)
        device = None
        if args.device != "waits" and real is None:
            known = simulation_devices(read_trace(args.trace))
            device = next((d for d in known if d.name.startswith(args.device)), None)
            if device is None:
                raise ValueError(f"no device model {args.device!r}; known: {[d.name for d in known]}")
        result = validate(args.trace, args.calibrate_from, device, real, args.expert_fraction, args.target)
    except (ValueError, TraceFormatError) as exc:
        print(f"fallbackgate trace validate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    m, p = result["measured"], result["predicted"]
    print(f"{result['controller']} at {result['budget_bytes'] / (1 << 20):.3f} MiB, device {result['device']} "
          f"(calibration: {result['calibration'] or 'none'}), {m['num_steps']} steps"
          + (f", predicting {result['target']}" if result["target"] != result["trace"] else ""))  # fmt: skip
    print(f"stall: measured {m['stall_s']:.3f} s, predicted {p['stall_s']:.3f} s ({result['stall_error']:+.1%})")
    print(f"mean TPOT: measured {m['mean_tpot_ms']:.2f} ms, predicted {p['mean_tpot_ms']:.2f} ms "
          f"({result['tpot_error']:+.1%})")  # fmt: skip
    verdict = "within" if result["within_bound"] else "OUTSIDE"
    print(f"{verdict} max(25 %, 1 ms per step) (stall {result['stall_within']}, TPOT {result['tpot_within']})")
    return 0 if result["within_bound"] else 1
