"""``fallbackgate report --trace DIR... --out FILE.md``: one markdown file answering PROBE.md's six questions
with the analyses' numbers (figures beside it), or saying what the traces cannot answer and what would."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from fallbackgate.tracing.analyze import TraceAnalysis
from fallbackgate.tracing.schema import TraceTable
from fallbackgate.tracing.synthetic import Planted

GIB = float(1 << 30)


def _f(value: float, digits: int = 3) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}g}"


def _pct(share: float) -> str:
    return "n/a (no such reads)" if share is None or math.isnan(share) else f"{100 * share:.1f} %"


def _figures(analysis: TraceAnalysis, name: str, report_dir: Path) -> list[str]:
    result = analysis.result(name)
    return [f"![{name}]({os.path.relpath(path, report_dir)})" for path in result.figures]


def _q1(a: TraceAnalysis, report_dir: Path) -> list[str]:
    marginal, flips = a.result("marginal_value"), a.result("flips")
    lines = ["| device | stall removed per GiB to experts (s) | per GiB to KV (s) | P99 TPOT removed per GiB "
             "experts / KV (ms) | next GiB to | best-split flips | static split's extra time |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for device in a.device_names:
        winner = next(r for r in marginal.rows if r.metric == "next_gib_to_experts" and r.device == device)
        cells = [
            _f(marginal.value("stall_s_reduced_per_gib_experts", device=device)),
            _f(marginal.value("stall_s_reduced_per_gib_kv", device=device)),
            f"{_f(marginal.value('p99_tpot_ms_reduced_per_gib_experts', device=device))} / "
            f"{_f(marginal.value('p99_tpot_ms_reduced_per_gib_kv', device=device))}",
            winner.params["winner"],
            f"{int(flips.value('num_flips', device=device))}",
            f"{100 * flips.value('static_over_per_window_time', device=device):.1f} %",
        ]
        lines.append(f"| {device} | " + " | ".join(cells) + " |")
    params = marginal.rows[0].params if marginal.rows else {}
    lines.append("")
    lines.append(
        f"Base budgets {params.get('expert_gib', 0):.3g} GiB experts + {params.get('kv_gib', 0):.3g} GiB KV, step "
        f"{params.get('delta_gib', 0):.3g} GiB; both kinds as LRU caches over the trace's own access sequence. "
        "\"Static split's extra time\" is the whole-trace best static split's total step time over that of the "
        "best split per window (0 % = a static budgeter loses nothing)."
    )
    return lines + ["", *_figures(a, "marginal_value", report_dir), *_figures(a, "flips", report_dir)]


def _q2(a: TraceAnalysis, report_dir: Path) -> list[str]:
    r = a.result("co_burst")
    if not r.rows:
        return r.notes
    lift = next(x for x in r.rows if x.metric == "lift")
    peak = next((x for x in r.rows if x.metric == "peak_lag"), None)
    lines = [
        f"P(expert miss ∧ KV miss in one step and layer) = {_f(r.value('p_both'))} against "
        f"{_f(r.value('p_product'))} if independent: lift **{_f(lift.value)}** (95 % bootstrap over steps "
        f"[{_f(lift.ci_low)}, {_f(lift.ci_high)}], {lift.params['num_cells']} cells).",
    ]
    if peak:
        lines.append(
            f"The per-step miss series cross-correlate most at lag **{int(peak.value)}** steps (KV after experts when "
            f"positive): r = {_f(peak.params['r'])} [{_f(peak.params['ci_low'])}, {_f(peak.params['ci_high'])}]"
            + (" (not significant: its interval contains 0)." if peak.params["ci_low"] <= 0 else ".")
        )
    has_interval = lift.ci_low is not None and not math.isnan(lift.ci_low) and not math.isnan(lift.ci_high)
    if not r.value("p_product"):  # one kind never missed: no coincidence could be seen either way
        lines.append(
            f"Verdict: **no data** — P(expert miss) = {_f(r.value('p_expert_miss'))}, P(KV miss) = "
            f"{_f(r.value('p_kv_miss'))}: one kind never missed, so this trace cannot say whether they burst together."
        )
    elif not has_interval:
        lines.append("Verdict: **undecided** — the bootstrap gave no interval for the lift.")
    else:
        verdict = "not independent" if lift.ci_low > 1 or lift.ci_high < 1 else "compatible with independence"
        lines.append(f"Verdict: the two kinds of miss are **{verdict}** in this trace.")
    shares = {x.metric: x.value for x in r.rows if x.metric.startswith(("io_overlap", "mean_queue"))}
    if shares:
        lines.append(
            f"Contention on the recorded I/O: an expert read was in flight with a KV read "
            f"{_pct(shares['io_overlap_share_expert'])} of the expert-read time "
            f"({_pct(shares['io_overlap_share_kv'])} of the KV-read time); reads met a queue depth of "
            f"{_f(shares['mean_queue_depth_at_submit'])} at submit. The device models give both kinds one link "
            "(one queue, one bandwidth), so co-bursts add their bytes."
        )
    else:
        lines.append("Contention: the trace has no reads in its io table; nothing to measure.")
    return lines + ["", *_figures(a, "co_burst", report_dir)]


def _q3(a: TraceAnalysis, report_dir: Path) -> list[str]:
    r = a.result("dual_miss")
    if not r.rows:
        return [*r.notes, "What would answer it: a run whose controller arbitrates late objects (joint: the "
                "arbitration table) under a budget where exact KV copies arrive late, recorded with "
                "`run --trace DIR`."]  # fmt: skip
    shares = [row for row in r.rows if row.metric == "chosen_share"]
    lines = ["What the controller served its late objects with, by phase and context length (share of the late "
             "objects in each):", "", "| phase | context tokens | served with | share |",
             "|---|---|---|---|"] if shares else []  # fmt: skip
    for row in shares:
        params = row.params
        lines.append(f"| {params['phase']} | {params['context']} | {params['option']} | {_f(row.value)} |")
    lines += ["", "| device | phase | recompute beats loading the KV block below (context tokens) |", "|---|---|---|"]
    for row in r.rows:
        if row.metric == "recompute_crossover_tokens":
            lines.append(f"| {row.device} | {row.params['phase']} | {_f(row.value, 4)} |")
    return lines + ["", *r.notes, *_figures(a, "dual_miss", report_dir)]


def _q4(a: TraceAnalysis, report_dir: Path) -> list[str]:
    r = a.result("prediction")
    device = a.device_names[0]
    lines = ["| predictor | precision | wrongly predicted (GiB) | wrongly fetched, est. (GiB) | covered misses (GiB) "
             f"| net link time saved on {device} (s) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for p in ("router", "kv_recency", "joint"):
        lines.append(
            f"| {p} | {_f(r.value('precision', predictor=p))} | "
            f"{_f(r.value('wrongly_predicted_bytes', predictor=p) / GIB)} | "
            f"{_f(r.value('wrongly_fetched_bytes', predictor=p) / GIB)} | "
            f"{_f(r.value('covered_miss_bytes', predictor=p) / GIB)} | "
            f"{_f(r.value('net_link_time_saved_s', predictor=p, device=device))} |"
        )
    return lines + ["", *r.notes, *_figures(a, "prediction", report_dir)]


def _q5(a: TraceAnalysis) -> list[str]:
    flips = a.result("flips")
    best = next(r for r in flips.rows if r.metric == "devices_disagreeing_on_best_share").params["best"]
    lines = ["| device | best whole-trace expert share | what-if? |", "|---|---|---|"]
    what_ifs = {n for n in a.device_names if "what-if" in n}
    lines += [f"| {d} | {_f(best[d])} | {'yes (assumed numbers)' if d in what_ifs else 'no (fitted)'} |" for d in best]
    distinct = len(set(best.values()))
    lines.append("")
    lines.append(f"The devices {'disagree' if distinct > 1 else 'agree'} on the best split ({distinct} distinct).")
    lines.append(
        "Not measured here: replaying the trace's reads against real RAM and disk (`trace simulate --io real`), "
        "queue-depth and I/O-size scans, GPU-direct storage and remote memory."
    )
    return lines


def _q6(a: TraceAnalysis) -> list[str]:
    counts = {}
    for table in (TraceTable.EXPERT_ACCESS, TraceTable.KV_ACCESS):
        tags = a.trace.tables[table].column("tag").to_pandas().astype(str)
        for tag, n in tags.value_counts().items():
            counts[tag] = counts.get(tag, 0) + int(n)
    total = sum(counts.values()) or 1
    mix = ", ".join(f"{t} {100 * n / total:.2f} %" for t, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return [
        f"Accesses by tag in this trace: {mix}.",
        "Every access carries the tag it was served with; attributing drift to tags is the audit's job "
        "(`fallbackgate audit`, the gate and the replay baseline compare each request's outputs with an exact "
        "baseline): the trace adds when and where each fallback happened, not whether it drifted.",
    ]


def _planted(a: TraceAnalysis) -> list[str]:
    planted = a.trace.metadata.get("planted")
    if not planted:
        return []
    p = Planted(**{k: tuple(v) if isinstance(v, list) else v for k, v in planted.items()})
    co, flips = a.result("co_burst"), a.result("flips")
    shares = [r.value for r in flips.rows if r.metric == "best_expert_share" and r.device == "measured"]
    half = len(shares) // 2
    rows = [
        ("same-cell lift", p.expected_lift, co.value("lift")),
        ("peak lag (steps)", p.kv_lag_steps, co.value("peak_lag")),
        ("best expert share, phase A", p.expert_share_a, float(np.median(shares[:half]))),
        ("best expert share, phase B", p.expert_share_b, float(np.median(shares[half:]))),
        ("best-split flips", 1, flips.value("num_flips", device="measured")),
        (
            "router precision",
            p.expected_router_precision(),
            a.result("prediction").value("precision", predictor="router"),
        ),
    ]
    for phase, name in ((0, "prefill"), (1, "decode")):
        found = a.result("dual_miss").value("recompute_crossover_tokens", device="measured", phase=name)
        rows.append((f"recompute crossover, {name} (tokens)", p.crossover_tokens(phase), found))
    lines = ["Planted trace: the parameters it was generated with against what the analyses found.", "",
             "| planted | value | recovered |", "|---|---|---|"]  # fmt: skip
    return lines + [f"| {n} | {_f(v, 4)} | {_f(f, 4)} |" for n, v, f in rows] + [""]


QUESTIONS = (
    "1. Is the marginal value of the next GiB stable?",
    "2. Are expert misses and KV misses correlated in time?",
    "3. On a dual miss, which action wins?",
    "4. Does joint prediction add information?",
    "5. Do devices flip the priorities?",
    "6. Can joint fallbacks be audited?",
)


def build_report(analyses: list[TraceAnalysis], out_file: Path) -> str:
    """The markdown text of the report over ``analyses`` (figures already written), also written to ``out_file``."""
    report_dir = out_file.parent
    lines = ["# fallbackgate trace report", ""]
    for a in analyses:
        meta = a.trace.metadata
        lines += [f"Trace `{a.trace.path}`: workload {a.trace.workload}, source {meta.get('source', '?')}, "
                  f"controller {meta.get('controller', '?')}, format v{meta.get('format_version')}."]  # fmt: skip
    lines.append("")
    if any(a.trace.metadata.get("source") == "synthetic" for a in analyses):
        lines += [
            "**Synthetic traces say nothing about a real model**: they check that the analyses recover what was "
            "planted. Answers for the bundled model need traces recorded with `run --trace DIR`.",
            "",
        ]
    sections = (lambda a: _q1(a, report_dir), lambda a: _q2(a, report_dir), lambda a: _q3(a, report_dir),
                lambda a: _q4(a, report_dir), _q5, _q6)  # fmt: skip
    for question, section in zip(QUESTIONS, sections, strict=True):
        lines += [f"## {question}", ""]
        for a in analyses:
            lines += [f"### {a.title}", "", *section(a), ""]
    lines += ["## Planted parameters", ""] if any(a.trace.metadata.get("planted") for a in analyses) else []
    for a in analyses:
        lines += _planted(a)
    lines += [
        "## What this machine cannot answer",
        "",
        "- Device numbers other than the fitted one are what-ifs (assumed latency, bandwidth, queue depth); "
        "measuring NVMe, GPU HBM over PCIe 5 or GPU-direct storage needs those devices.",
        "- Whether a joint controller beats two simple ones needs the 2-D budget sweep on recorded traces of the "
        "four workloads at ≥ 3 seeds, run through `trace simulate` and validated against measured runs.",
        "",
    ]
    text = "\n".join(lines)
    out_file.write_text(text)
    return text
