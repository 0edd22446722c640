"""Where a sweep cell's slowest decoding request spent its time, read back from the sweep's ledger.

    python -m fallbackgate.sweep.anatomy fallbackgate/sweep_results/sweep.json --ledger sqlite:///sweep.sqlite

A request's TPOT (wall clock, as recorded) is split over its decode steps — the steps after its first token
that sampled one of its tokens — into the **expert stall** (``steps.transfer_exposed_s``: seconds the compute
thread spent in or waiting for expert reads), the rest of those steps' time split by whether the step also
carried prefill tokens (``kind`` ``mixed``: a prompt chunk batched beside the decodes) or not, and the **gap**
between its steps (steps it was not in, the scheduler, recording). Summed over its decode steps and divided
by its tokens after the first, the four parts add up to its TPOT.

The **stall ceiling** of a run is ``1 − P99(TPOT − stall) / P99(TPOT)``: the P99 TPOT gain a controller
would reach against it by removing every expert stall and changing nothing else. Where a partner's ceiling
is a few per cent, no memory controller can beat it by much: the requests were not waiting for memory.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import pathlib
import statistics
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select

from fallbackgate.ledger.db import Ledger, LedgerError, open_ledger
from fallbackgate.ledger.models import Request, Run, Step, StepRequest
from fallbackgate.sweep.intervals import interval
from fallbackgate.sweep.metrics import p99
from fallbackgate.sweep.plot import anatomy_bars
from fallbackgate.sweep.summary import INDEPENDENT, JOINT, STATIC, chosen_share, gain

PARTS: dict[str, str] = {
    "stall_ms": "expert stall",
    "prefill_step_ms": "steps with a prefill chunk",
    "decode_step_ms": "decode-only steps",
    "gap_ms": "between its steps",
}
"""The parts of a request's TPOT (ms per output token after the first), in order, with their labels; each cell of
:func:`sweep_anatomy` repeats them (``parts``) so readers of the JSON need not spell them."""
RUNS: dict[str, str] = {JOINT: "joint", "chosen_static": "chosen static", INDEPENDENT: "two LRUs"}
"""The runs a cell compares, in order, with their labels (repeated in each cell as ``runs``)."""


@dataclasses.dataclass(slots=True)
class RequestAnatomy:
    """One request's TPOT split into its parts (ms per output token after the first), and its TTFT beside the
    time of its own prefill steps."""

    request_id: str  # the ledger's request id
    tpot_ms: float  # as recorded: (finish − first token) / (tokens − 1), wall clock
    stall_ms: float  # expert-read time the compute thread was exposed to in its decode steps
    prefill_step_ms: float  # the rest of its decode steps that also carried prefill tokens
    decode_step_ms: float  # the rest of its decode-only steps
    gap_ms: float  # the rest: steps without it or that sampled nothing for it, scheduling, recording
    ttft_ms: float  # as recorded: arrival to first token, wall clock
    ttft_own_steps_ms: float  # the steps that computed its prompt, up to the one that sampled its first token
    ttft_own_stall_ms: float  # of which exposed expert reads
    ttft_target_ms: float | None  # its class's TTFT target (None: no SLO)

    @property
    def stall_free_tpot_ms(self) -> float:
        """Its TPOT with every expert stall removed and nothing else changed."""
        return self.tpot_ms - self.stall_ms


_Row = tuple[str, float, float]  # (step kind, wall s, exposed s)


def request_anatomies(ledger: Ledger, run_id: int) -> list[RequestAnatomy]:
    """Every request of the run with at least two output tokens, split into its TPOT's parts."""
    steps_q = (
        select(StepRequest.request_id, StepRequest.is_sampled, Step.kind, Step.wall_s, Step.transfer_exposed_s)
        .join(Step, (Step.run_id == StepRequest.run_id) & (Step.step_id == StepRequest.step_id))
        .where(StepRequest.run_id == run_id)
        .order_by(StepRequest.step_id)
    )
    req_q = select(Request.request_id, Request.num_output_tokens, Request.tpot_s, Request.ttft_s, Request.slo).where(
        Request.run_id == run_id
    )
    prompt: dict[str, list[_Row]] = collections.defaultdict(list)  # its steps up to its first token
    decode: dict[str, list[_Row]] = collections.defaultdict(list)  # its sampled steps after it
    has_first: set[str] = set()
    with ledger.engine.connect() as conn:
        for rid, is_sampled, kind, wall_s, exposed_s in conn.execute(steps_q):
            row = (kind, wall_s or 0.0, exposed_s or 0.0)
            if rid not in has_first:
                prompt[rid].append(row)
                if is_sampled:
                    has_first.add(rid)
            elif is_sampled:
                decode[rid].append(row)
        requests = list(conn.execute(req_q))
    out = []
    for rid, num_output, tpot_s, ttft_s, slo in requests:
        steps = decode.get(rid, [])
        if num_output < 2 or tpot_s is None or ttft_s is None or not steps:
            continue
        per_token = 1e3 / (num_output - 1)
        stall = sum(x for _, _, x in steps)
        mixed = sum(w - x for k, w, x in steps if k != "decode")
        plain = sum(w - x for k, w, x in steps if k == "decode")
        tpot = tpot_s * 1e3
        target = (slo or {}).get("ttft_ms")
        out.append(RequestAnatomy(rid, tpot, stall * per_token, mixed * per_token, plain * per_token,
                                  tpot - (stall + mixed + plain) * per_token, ttft_s * 1e3,
                                  1e3 * sum(w for _, w, _ in prompt[rid]), 1e3 * sum(x for _, _, x in prompt[rid]),
                                  None if target is None else float(target)))  # fmt: skip
    return out


def run_anatomy(anatomies: list[RequestAnatomy]) -> dict[str, float]:
    """A run's P99 TPOT, the parts of the request at that rank, P99 of the stall-free TPOTs and the ceiling;
    mean TTFT, its own prefill steps and their stall, and the share of requests meeting the TTFT target as run
    and without their own steps' stall."""
    if not anatomies:
        return {}
    ranked = sorted(anatomies, key=lambda a: a.tpot_ms)
    at_p99 = ranked[min(len(ranked) - 1, max(0, -(-99 * len(ranked) // 100) - 1))]
    tpot_p99, free_p99 = p99([a.tpot_ms for a in anatomies]), p99([a.stall_free_tpot_ms for a in anatomies])
    targeted = [a for a in anatomies if a.ttft_target_ms is not None]
    out = {"tpot_p99_ms": tpot_p99, "stall_free_tpot_p99_ms": free_p99,
           "stall_ceiling": 1.0 - free_p99 / tpot_p99 if tpot_p99 > 0 else 0.0,
           **{f"p99_request_{k}": getattr(at_p99, k) for k in PARTS},
           **{k: statistics.fmean(getattr(a, k) for a in anatomies)
              for k in ("ttft_ms", "ttft_own_steps_ms", "ttft_own_stall_ms")}}  # fmt: skip
    if targeted:
        out["ttft_met"] = statistics.fmean(a.ttft_ms <= a.ttft_target_ms for a in targeted)
        out["ttft_met_without_own_stall"] = statistics.fmean(
            a.ttft_ms - a.ttft_own_stall_ms <= a.ttft_target_ms for a in targeted
        )
        out["ttft_target_ms"] = statistics.fmean(a.ttft_target_ms for a in targeted)
    return out


def sweep_anatomy(points: Iterable[dict[str, Any]], ledger: Ledger, held_out: int) -> dict[str, Any]:
    """Per workload@RAM cell: each controller's mean run anatomy over seeds, and per partner (the chosen static
    split, two LRUs) its stall ceiling beside joint's measured P99 TPOT gain, intervals over seeds."""
    points = list(points)
    _check_runs(points, ledger)
    cells: dict[str, dict[int, list[dict[str, Any]]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for p in points:
        p = {**p, "anatomy": run_anatomy(request_anatomies(ledger, p["run_id"]))}
        _check_timings(p, ledger)
        cells[f"{p['workload']}@{p['ram_frac']}"][p["seed"]].append(p)
    out: dict[str, Any] = {}
    for key, by_seed in sorted(cells.items()):
        share = chosen_share(by_seed, held_out)
        picks = {JOINT: pick_joint, "chosen_static": lambda p, s=share: p["controller"] == STATIC
                 and p["kv_share"] == s, INDEPENDENT: lambda p: p["controller"] == INDEPENDENT}  # fmt: skip
        runs = {name: picks[name] for name in RUNS}
        partners = dict(list(runs.items())[1:])
        cell: dict[str, Any] = {"chosen_static_kv_share": share, "parts": dict(PARTS), "runs": dict(RUNS),
                                "mean": {}, "vs": {}}  # fmt: skip
        for name, pick in runs.items():
            found = [p["anatomy"] for ps in by_seed.values() for p in ps if pick(p) and p["anatomy"]]
            keys = sorted(set.intersection(*(set(a) for a in found))) if found else []
            cell["mean"][name] = {k: statistics.fmean(a[k] for a in found) for k in keys}
        for name, pick in partners.items():
            ceilings, gains = [], []
            for ps in by_seed.values():
                joint = next((p["anatomy"] for p in ps if pick_joint(p)), None)
                partner = next((p["anatomy"] for p in ps if pick(p)), None)
                if joint and partner:
                    ceilings.append(partner["stall_ceiling"])
                    gains.append(gain("tpot_p99_ms", joint["tpot_p99_ms"], partner["tpot_p99_ms"]))
            cell["vs"][name] = {"stall_ceiling": interval(ceilings), "joint_tpot_p99_gain": interval(gains)}
        out[key] = cell
    return out


def _check_runs(points: list[dict[str, Any]], ledger: Ledger) -> None:
    """Raise LedgerError unless every point's run is in the ledger with the point's controller (another sweep's
    ledger would give other runs' numbers)."""
    run_ids = [p["run_id"] for p in points]
    with ledger.engine.connect() as conn:
        found = dict(conn.execute(select(Run.id, Run.controller).where(Run.id.in_(run_ids))).all())
    for p in points:
        if found.get(p["run_id"]) != p["controller"]:
            why = "is not in it" if p["run_id"] not in found else f"is a {found[p['run_id']]} run"
            raise LedgerError(f"run {p['run_id']} ({p['controller']}, {p['workload']} seed {p['seed']}) {why}: "
                              f"is this the sweep's ledger ({ledger.display_url})?")  # fmt: skip


def _check_timings(point: dict[str, Any], ledger: Ledger) -> None:
    """Raise LedgerError unless the run's recorded P99 TPOT is the point's (wall clock is never the same twice: a
    same-shaped sweep recorded in another ledger has the same run ids, controllers and tokens)."""
    recorded, measured = point.get("metrics", {}).get("tpot_p99_ms"), point["anatomy"].get("tpot_p99_ms")
    if recorded is not None and measured is not None and not math.isclose(recorded, measured, rel_tol=1e-6):
        raise LedgerError(f"run {point['run_id']} ({point['workload']} seed {point['seed']} {point['controller']}) "
                          f"has P99 TPOT {measured:.4f} ms in {ledger.display_url}, the sweep says {recorded:.4f}: "
                          "is this the sweep's ledger?")  # fmt: skip


def pick_joint(point: dict[str, Any]) -> bool:
    """Whether a sweep point is a joint run."""
    return point["controller"] == JOINT


def markdown_table(anatomy: dict[str, Any]) -> str:
    """One row per cell: the P99 request's parts per controller and each partner's stall ceiling vs joint's gain."""
    head = ("| workload @ RAM | P99 request, ms/token: stall + prefill-step + decode-step + gap — joint / chosen "
            "static / two LRUs | stall ceiling vs joint's P99 TPOT gain, %: chosen static | two LRUs |")  # fmt: skip
    lines = [head, "|---|---|---|---|"]
    for key, cell in anatomy.items():
        parts = []
        for name in RUNS:
            m = cell["mean"].get(name) or {}
            parts.append(" + ".join(f"{round(m.get(f'p99_request_{k}', float('nan')), 1) + 0.0:.1f}" for k in PARTS))
        vs = [f"{_pct(cell['vs'][n]['stall_ceiling'])} vs {_pct(cell['vs'][n]['joint_tpot_p99_gain'])}"
              for n in list(RUNS)[1:]]  # fmt: skip
        lines.append(f"| {key} | {' / '.join(parts)} | {vs[0]} | {vs[1]} |")
    return "\n".join(lines)


def ttft_table(anatomy: dict[str, Any]) -> str:
    """One row per cell: TTFT against its target per controller (mean over seeds)."""
    head = ("| workload @ RAM | TTFT target, ms | joint / chosen static / two LRUs: mean TTFT, ms (own prefill steps; "
            "their expert stall) | share meeting the TTFT target: as run → without own stall |")  # fmt: skip
    lines = [head, "|---|---|---|---|"]
    for key, cell in anatomy.items():
        runs = [cell["mean"].get(name) or {} for name in RUNS]
        target = runs[0].get("ttft_target_ms", float("nan"))
        times = " / ".join(f"{m.get('ttft_ms', float('nan')):.1f} ({m.get('ttft_own_steps_ms', float('nan')):.1f}; "
                           f"{m.get('ttft_own_stall_ms', float('nan')):.1f})" for m in runs)  # fmt: skip
        met = " / ".join("–" if "ttft_met" not in m else f"{100 * m['ttft_met']:.0f} → "
                         f"{100 * m['ttft_met_without_own_stall']:.0f} %" for m in runs)  # fmt: skip
        lines.append(f"| {key} | {target:.1f} | {times} | {met} |")
    return "\n".join(lines)


def _pct(iv: dict[str, float]) -> str:
    if not iv["n"]:
        return "–"
    return f"{100 * iv['mean']:+.0f} [{100 * iv['lo']:+.0f}, {100 * iv['hi']:+.0f}]"


def main(argv: list[str] | None = None) -> int:
    """Add ``anatomy`` to a sweep.json in place (as ``fallbackgate sweep`` writes it), draw ``anatomy.png``
    beside it and print the tables."""
    parser = argparse.ArgumentParser(prog="python -m fallbackgate.sweep.anatomy", description=__doc__.split("\n")[0])
    parser.add_argument("sweep", type=pathlib.Path, help="a sweep.json (rewritten with its anatomy)")
    parser.add_argument("--ledger", required=True, help="the sweep's ledger URL (its runs are the points' run_id)")
    args = parser.parse_args(argv)
    result = json.loads(args.sweep.read_text())
    try:
        with open_ledger(args.ledger, read_only=True, must_exist=True) as ledger:
            held_out = result.get("config", {}).get("held_out_seed", 2)
            result["anatomy"] = sweep_anatomy(result["points"], ledger, held_out)
    except LedgerError as exc:
        parser.exit(2, f"python -m fallbackgate.sweep.anatomy: error: {exc}\n")
    args.sweep.write_text(json.dumps(result, indent=1) + "\n")
    anatomy_bars(result["anatomy"], args.sweep.with_name("anatomy.png"))
    print(markdown_table(result["anatomy"]))
    print(ttft_table(result["anatomy"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
