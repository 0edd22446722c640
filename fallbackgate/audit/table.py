"""The gate's verdict as a table: a line per request (both verdict halves) and the run, with the floor and
the thresholds it was judged against."""

from __future__ import annotations

import sys
from typing import TextIO

from fallbackgate.audit.coverage import pair_text
from fallbackgate.audit.gate import RunVerdict
from fallbackgate.audit.tolerances import tolerance
from fallbackgate.engine.tags import Exactness


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _word(passed: bool | None) -> str:
    return "-" if passed is None else ("pass" if passed else "FAIL")


def print_table(verdict: RunVerdict, out: TextIO | None = None) -> None:
    """Print one line per request and a run line (to stdout by default)."""
    out = out or sys.stdout
    head = (
        f"{'request':<24} {'served':<11} {'mean KL':>9} {'p99 KL':>9} {'max KL':>9} {'top1':>6} "
        f"{'quality':>7} {'correct':>7} verdict"
    )
    print(head, file=out)
    for v in verdict.requests:
        s = v.stats or {}
        halves = f"{_word(v.quality_passed if s else None):>7} {_word(v.correctness_passed):>7}"
        where = (
            ""
            if v.passed or v.step is None
            else f" [pos {v.position}, step {v.step}, layer {v.layer}, tags {','.join(v.tags)}]"
        )
        print(
            f"{v.request_id:<24} {v.served.value:<11} {_fmt(s.get('mean_kl')):>9} {_fmt(s.get('p99_kl')):>9} "
            f"{_fmt(s.get('max_kl')):>9} {_fmt(s.get('top1_agreement')):>6} {halves} "
            f"{'PASS' if v.passed else 'FAIL'} {v.reason}{where}",
            file=out,
        )
    floor = verdict.floor
    if floor is not None:
        print(
            f"numeric floor ({floor.dtype}, exact vs exact): max KL {floor.max_kl:.3g}, p99 {floor.p99_kl:.3g}; "
            f"tolerance exact-only {tolerance(Exactness.EXACT, floor):.3g}, with equivalent tags "
            f"{tolerance(Exactness.EQUIVALENT, floor):.3g}; budgets allow 10x the floor's mean and p99 on top",
            file=out,
        )
    if verdict.missing_step_ids:
        steps = verdict.missing_step_ids
        more = f" and {len(steps) - 20} more" if len(steps) > 20 else ""
        print(f"ledger incomplete at steps {', '.join(map(str, steps[:20]))}{more}", file=out)
    if verdict.missing_pairs:
        print(f"missing (step, request) rows: {pair_text(verdict.missing_pairs)}", file=out)
    result = "PASS" if verdict.passed else "FAIL: " + "; ".join(verdict.reasons)
    print(
        f"run {verdict.run_id} ({verdict.status}, {len(verdict.requests)} requests): {result}",
        file=out,
    )


