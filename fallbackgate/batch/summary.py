"""The end of ``fallbackgate run``'s output: SLO misses, the gate's table, totals and where to look next."""

from __future__ import annotations

from collections import Counter
from typing import Any, TextIO

from fallbackgate.audit.gate import RunVerdict
from fallbackgate.audit.table import print_table
from fallbackgate.batch.report import slo_attainment
from fallbackgate.batch.session import RunOutcome
from fallbackgate.engine.controller import Controller


def print_slo_misses(outcome: RunOutcome, slos: dict[str, dict[str, Any]] | None, out: TextIO) -> None:
    """Per class with an SLO: how many requests met it, and each miss with its measured and target times."""
    by_id = {o.request_id: o for o in outcome.outputs}
    for name, entry in sorted(slo_attainment(outcome, slos).items()):
        targets = f"TTFT <= {entry['ttft_ms']:g} ms, TPOT <= {entry['tpot_ms']:g} ms"
        print(f"SLO {name}: {entry['num_met']} of {entry['num_requests']} requests met {targets} (measured)", file=out)
        for rid in entry["missed"][:10]:
            o = by_id[rid]
            print(f"  missed {rid}: TTFT {1e3 * o.ttft_s:.1f} ms, TPOT {1e3 * o.tpot_s:.1f} ms", file=out)
        if len(entry["missed"]) > 10:
            print(f"  ... and {len(entry['missed']) - 10} more", file=out)


def print_summary(
    outcome: RunOutcome,
    verdict: RunVerdict,
    num_audited: int,
    slos: dict[str, dict[str, Any]] | None,
    ledger_url: str,
    out: TextIO,
) -> None:
    """SLO misses, the gate's table (on PASS too), wall time and tokens/s, the ledger and the next commands."""
    print(file=out)
    print_slo_misses(outcome, slos, out)
    print_table(verdict, out)
    num_tokens = sum(len(o.output_token_ids) for o in outcome.outputs)
    rate = num_tokens / outcome.wall_s if outcome.wall_s > 0 else 0.0
    print(
        f"run {verdict.run_id}: {'PASS' if verdict.passed else 'FAIL'} ({num_audited} of {len(outcome.outputs)} "
        f"requests audited); {num_tokens} tokens in {outcome.wall_s:.2f} s wall = {rate:.1f} tokens/s",
        file=out,
    )
    print(f"ledger: {ledger_url}", file=out)
    print(
        f"look closer: fallbackgate gate --ledger {ledger_url} --run {verdict.run_id}  |  "
        f"fallbackgate dashboard --ledger {ledger_url}",
        file=out,
    )


def print_prefix_reuse(memory: dict[str, Any], out: TextIO) -> None:
    """One line on prefix reuse: blocks kept and reused (from RAM and from the spill), prefill tokens skipped."""
    got = memory.get("prefix_reuse")
    if not got:
        return
    if not got["is_enabled"]:
        print("prefix reuse: off (--no-prefix-reuse / memory.prefix_reuse)", file=out)
        return
    print(
        f"prefix reuse: {got['num_reused_blocks']} blocks reused by {got['num_reused_requests']} requests "
        f"({got['num_reused_resident']} layer blocks resident, {got['num_reused_spilled']} read exact_load from the "
        f"spill), {got['num_reused_tokens']} prefill tokens skipped; {got['num_kept_blocks']} blocks kept, "
        f"{got['num_kept_now']} still kept; {got['num_checksum_failures']} checksum failures",
        file=out,
    )


def print_slips(controller: Controller, out: TextIO) -> None:
    """One line summarising the SLO slips a controller recorded (nothing when there were none)."""
    slips = getattr(controller, "slips", [])
    if slips:
        reasons = Counter(s.reason for s in slips)
        print(
            f"\nSLO slips (deadline missed to keep a quality budget or class): {len(slips)} {dict(reasons)}", file=out
        )
    arbitrations = getattr(controller, "arbitrations", [])
    if arbitrations:
        for kind in ("kv_block", "expert"):
            choices = Counter(a.choice.value for a in arbitrations if getattr(a, "object_kind", kind) == kind)
            if choices:
                print(f"late {kind} arbitrations: {sum(choices.values())} {dict(choices)}", file=out)
