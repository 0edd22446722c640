"""Request drill-down: tags per step × layer, quality budget spent against remaining, per-position KL,
the first divergence and the SLO timeline (measured and modeled)."""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from fallbackgate.dashboard import charts, data
from fallbackgate.ledger.dashboard_queries import RunFilter

BUDGET_CHECKS = (  # budget key, statistic, label, True when larger is worse
    ("max_mean_kl", "mean_kl", "mean KL", True),
    ("max_p99_kl", "p99_kl", "p99 KL", True),
    ("min_top1_agreement", "top1_agreement", "top-1 agreement", False),
    ("max_approx_fraction", "approx_fraction", "approximate fraction", True),
)


def _pick_run(url: str, f: RunFilter) -> int | None:
    options: list[int | str] = list(data.run_ids(url, f))
    wanted = st.query_params.get("run")
    index = 0 if options else None
    if wanted is not None and wanted in {str(o) for o in options}:
        index = [str(o) for o in options].index(wanted)
    elif wanted is not None:
        options = [wanted, *options]
        index = 0
    choice = st.selectbox("Run", options, index=index, key="dd_run", accept_new_options=True)
    if choice is None:
        return None
    try:
        return int(choice)
    except (TypeError, ValueError):
        st.warning(f"{choice!r} is not a run id (run ids are whole numbers).")
        return None


def _pick_request(url: str, run_id: int, f: RunFilter) -> str | None:
    reqs = data.run_requests(url, run_id, f.request_classes)
    options = list(reqs["request_id"])
    wanted = st.query_params.get("request")
    if wanted is not None and wanted not in options:
        options = [wanted, *options]
    index = options.index(wanted) if wanted is not None else (0 if options else None)
    return st.selectbox("Request", options, index=index, key="dd_request", accept_new_options=True)


def budget_table(summary: dict[str, Any], by_exactness: dict[str, int]) -> pd.DataFrame:
    """Each limit of the request's quality budget with the measured value, spent share and remaining."""
    total = sum(by_exactness.values())
    measured = dict(summary, approx_fraction=(by_exactness.get("approximate", 0) / total) if total else 0.0)
    rows = []
    for key, stat, label, larger_worse in BUDGET_CHECKS:
        limit = (summary.get("budget") or {}).get(key)
        value = measured.get(stat)
        if limit is None or value is None:
            continue
        remaining = (limit - value) if larger_worse else (value - limit)
        spent = (value / limit if limit else float("inf")) if larger_worse else None
        rows.append(
            {
                "limit": key,
                "statistic": label,
                "budget": limit,
                "measured": value,
                "spent": spent,
                "remaining": remaining,
                "within": remaining >= 0,
            }
        )
    return pd.DataFrame(rows, columns=["limit", "statistic", "budget", "measured", "spent", "remaining", "within"])


def _spent_text(spent: float | None) -> str:
    if spent is None or pd.isna(spent):
        return "—"
    return "over (limit 0)" if spent == float("inf") else f"{100 * spent:.0f} %"


def budget_display(table: pd.DataFrame) -> Any:
    """The budget table as people read it: numbers at 3 significant digits, spent as a percentage of the
    limit, and a pass/fail column in colour (no raw floats, "Infinity" or unticked boxes)."""
    shown = pd.DataFrame(
        {
            "statistic": table["statistic"],
            "budget": table["budget"].map(lambda v: f"{v:.3g}"),
            "measured": table["measured"].map(lambda v: f"{v:.3g}"),
            "spent of limit": table["spent"].map(_spent_text),
            "remaining": table["remaining"].map(lambda v: f"{v:.3g}"),
            "verdict": table["within"].map(lambda ok: "pass" if ok else "FAIL"),
        }
    )
    colour = {"pass": "color: #2e7d32; font-weight: 600", "FAIL": "color: #c62828; font-weight: 600"}
    return shown.style.map(lambda v: colour.get(v, ""), subset=["verdict"])


def _metrics(d: dict[str, Any]) -> None:
    s = d["summary"]
    fd = s.get("first_divergence")
    cols = [*st.columns(3), *st.columns(3)]
    cols[0].metric("Mean KL", "—" if s.get("mean_kl") is None else f"{s['mean_kl']:.3e}")
    cols[1].metric("p99 KL", "—" if s.get("p99_kl") is None else f"{s['p99_kl']:.3e}")
    cols[2].metric("Top-1 agreement", "—" if s.get("top1_agreement") is None else f"{s['top1_agreement']:.4f}")
    cols[3].metric("PPL ratio", "—" if s.get("ppl_ratio") is None else f"{s['ppl_ratio']:.5f}")
    cols[4].metric("First divergence", "none" if fd is None else f"position {fd}")
    cols[5].metric("Verdict", s.get("verdict") or "not recorded")
    v = d["verdict"]
    halves = st.columns(3)
    halves[0].metric("Quality (vs exact baseline)", _half(v, "quality_passed"))
    halves[1].metric("Correctness (vs replay)", _half(v, "correctness_passed"))
    replay = s.get("replay_max_kl")
    halves[2].metric("Max KL served vs replay", "not replayed (exact only)" if replay is None else f"{replay:.3e}")
    if s.get("replay_routing_swaps"):
        st.info(
            f"The replay routed {s['replay_routing_swaps']} token(s) as served across a router near-tie (the k-th "
            "expert and the next within rounding): the step's recorded routing digest says which way it went."
        )
    if s.get("replay_error"):
        st.error(f"The replay could not follow this request's recorded actions: {s['replay_error']}")
    if v is not None and not v["passed"]:
        st.warning(
            f"Gate failed: {v['reason']} — first divergence at position {v['first_divergence_position']}, "
            f"step {v['first_divergence_step']}, layer {v['first_divergence_layer']}, "
            f"tags {', '.join(v['first_divergence_tags'] or [])}"
        )


def _half(verdict: dict[str, Any] | None, key: str) -> str:
    """A verdict half as a word: pass, fail, or not judged."""
    value = None if verdict is None else verdict.get(key)
    return "not judged" if value is None else ("pass" if value else "FAIL")


def _kl_chart(pos: pd.DataFrame, first: int | None) -> alt.LayerChart:
    line = (
        alt.Chart(pos)
        .mark_line(point=True)
        .encode(
            x=alt.X("position:Q", title="output position"),
            y=alt.Y("kl:Q", title="KL (nats)"),
            tooltip=["position", "step_id", "token_id", "kl", "top1_agree", "delta_p"],
        )
    )
    marks = pos[pos["position"] == first] if first is not None else pos.iloc[0:0]
    dot = alt.Chart(marks).mark_rule(color="#d1495b").encode(x="position:Q", tooltip=["position:Q", "kl:Q"])
    return alt.layer(line, dot)


def slo_targets(slo: dict[str, Any] | None) -> dict[str, float]:
    """``ttft_s`` and ``tpot_s`` targets from a request's SLO (``*_s`` or ``*_ms`` keys), where given."""
    out = {}
    for name in ("ttft", "tpot"):
        if (slo or {}).get(f"{name}_s") is not None:
            out[f"{name}_s"] = float(slo[f"{name}_s"])
        elif (slo or {}).get(f"{name}_ms") is not None:
            out[f"{name}_s"] = float(slo[f"{name}_ms"]) / 1000.0
    return out


def _slo_chart(tl: pd.DataFrame, slo: dict[str, Any] | None) -> alt.LayerChart:
    long = tl.melt(id_vars=["step_id", "kind"], value_vars=["cum_wall_s", "cum_modeled_s"], var_name="time")
    long["time"] = long["time"].map({"cum_wall_s": "measured", "cum_modeled_s": "modeled"})
    long["value"] = 1e3 * long["value"]  # ms, as every time shown to people
    chart = (
        alt.Chart(long)
        .mark_line(point=True)
        .encode(
            x=alt.X("step_id:Q", title="step"),
            y=alt.Y("value:Q", title="elapsed ms (steps of this request)"),
            color=alt.Color("time:N", title=None),
            tooltip=["step_id", "kind", "time", "value"],
        )
    )
    ttft = slo_targets(slo).get("ttft_s")
    ttft = None if ttft is None else 1e3 * ttft
    on_chart = ttft is not None and ttft <= 2 * float(long["value"].max() or 0.0)  # else it flattens the lines
    rows = [{"label": "TTFT target", "value": ttft}] if on_chart else []
    rules = pd.DataFrame(rows, columns=["label", "value"])
    rule = alt.Chart(rules).mark_rule(strokeDash=[4, 4]).encode(y="value:Q", tooltip=["label:N", "value:Q"])
    return alt.layer(chart, rule)


def render(url: str, f: RunFilter) -> None:
    """Draw the Request drill-down page."""
    st.header("Request drill-down")
    left, right = st.columns(2)
    with left:
        run_id = _pick_run(url, f)
    if run_id is None:
        st.info("No run selected (no runs match the filters).")
        return
    with right:
        request_id = _pick_request(url, run_id, f)
    d = data.request_detail(url, run_id, request_id) if request_id is not None else None
    if d is None:
        st.warning(f"Run {run_id} has no request {request_id!r}.")
        return
    _metrics(d)
    s = d["summary"]
    st.subheader("Tags per step × layer")
    st.altair_chart(charts.tag_heatmap(d["grid"]), width="stretch")
    st.subheader("Quality budget: spent against remaining")
    table = budget_table(s, d["exactness"])
    if table.empty:
        st.info("No quality budget was recorded for this request.")
    else:
        st.dataframe(budget_display(table), hide_index=True, key="dd_budget")
    tl = d["timeline"]
    st.metric("Predicted cost spent (approximate tags)", f"{tl['predicted_cost'].sum() if not tl.empty else 0.0:.4g}")
    st.subheader("KL per output position")
    if d["positions"].empty:
        st.info("This request was not audited: no per-position diffs.")
    else:
        st.altair_chart(_kl_chart(d["positions"], s.get("first_divergence")), width="stretch")
    st.subheader("SLO timeline")
    cols = st.columns(4)
    for col, key, label in zip(
        cols,
        ("ttft_s", "modeled_ttft_s", "tpot_s", "modeled_tpot_s"),
        ("TTFT measured", "TTFT modeled", "TPOT measured", "TPOT modeled"),
        strict=True,
    ):
        col.metric(label, "—" if s.get(key) is None else f"{1e3 * s[key]:.4g} ms")
    targets = slo_targets(s.get("slo"))
    st.caption(
        "SLO targets: "
        + (", ".join(f"{k.removesuffix('_s').upper()} {1e3 * v:.4g} ms" for k, v in targets.items()) or "none")
    )
    if not tl.empty:
        st.altair_chart(_slo_chart(tl, s.get("slo")), width="stretch")
