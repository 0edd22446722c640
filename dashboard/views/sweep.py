"""Budget sweep: expert × KV budget heatmaps from sweep runs, one per controller."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from fallbackgate.dashboard import sweep_data
from fallbackgate.ledger.dashboard_queries import RunFilter
from fallbackgate.ledger.db import Ledger

LABELS = {
    "tpot_mean_ms": "TPOT, mean (ms, measured)",
    "tpot_p99_ms": "TPOT, p99 (ms, measured)",
    "ttft_mean_ms": "TTFT, mean (ms, measured)",
    "mean_kl": "mean KL against exact (nats)",
    "p99_kl": "p99 KL against exact (nats)",
    "slo_attainment": "SLO attainment (measured)",
    "tokens_per_s": "tokens per second (measured)",
}


def label(metric: str) -> str:
    """A metric's name as people read it (units where the name says them)."""
    if metric in LABELS:
        return LABELS[metric]
    text = metric.replace("_", " ")
    for suffix, unit in ((" ms", " (ms)"), (" s", " (s)"), (" bytes", " (bytes)")):
        if text.endswith(suffix):
            return text[: -len(suffix)] + unit
    return text


def heatmap(df: pd.DataFrame, metric: str) -> alt.Chart:
    """Expert budget × KV budget cells coloured (and labelled) by ``metric``, one panel per controller."""
    unit = " (" + "/".join(sorted(set(df["budget_unit"].dropna()) - {""})) + ")" if "budget_unit" in df else ""
    unit = "" if unit == " ()" else unit
    base = alt.Chart(df).encode(
        x=alt.X("expert_budget:O", title=f"expert budget{unit}"),
        y=alt.Y("kv_budget:O", title=f"KV budget{unit}", sort="descending"),
    )
    legend = alt.Legend(orient="bottom", title=label(metric))
    cells = base.mark_rect().encode(color=alt.Color(f"{metric}:Q", legend=legend), tooltip=list(df.columns))
    text = base.mark_text(fontSize=11).encode(text=alt.Text(f"{metric}:Q", format=".3g"))
    layered = alt.layer(cells, text, data=df).properties(width=alt.Step(64), height=alt.Step(40))
    return layered.facet(facet=alt.Facet("controller:N", title="controller"), columns=2)  # wraps: never clipped


def render(url: str, f: RunFilter, ledger: Ledger | None = None) -> None:
    """Draw the Budget sweep page."""
    st.header("Budget sweep")
    df, problems = sweep_data.load_sweep(ledger)
    for p in problems:
        st.warning(f"Could not read sweep results from {p}")
    if df.empty:
        st.info(
            "No sweep results yet. Run `fallbackgate sweep` and point the dashboard at its JSON output with "
            f"${sweep_data.ENV_SWEEP}=PATH (a file or a directory of *.json files)."
        )
        return
    metrics = sweep_data.metric_columns(df)
    if not metrics:
        st.warning("The sweep results hold no numeric metric to draw.")
        return
    metric = st.selectbox("Metric", metrics, key="sweep_metric", format_func=label)
    controllers = sorted(df["controller"].astype(str).unique())
    st.metric("Controllers", len(controllers))
    st.altair_chart(heatmap(df, metric), width="content")
    st.dataframe(df, hide_index=True, key="sweep_points")
    show_verdicts()
    parts, ceilings, problems = sweep_data.load_anatomy()
    for p in problems:
        st.warning(p)
    if not parts.empty:
        st.subheader("Where the slowest request's time goes")
        sources = sorted(parts["source"].unique())
        source = st.selectbox("Sweep", sources, key="anatomy_source") if len(sources) > 1 else sources[0]
        parts, ceilings = parts[parts["source"] == source], ceilings[ceilings["source"] == source]
        st.caption(
            "The P99 request's TPOT per cell, ms per token (wall clock, mean over seeds), split into the parts "
            "the sweep names; the stall ceiling is the P99 TPOT gain of removing every expert stall of the "
            "partner's runs."
        )
        st.altair_chart(anatomy_bars(parts), width="content")
        st.dataframe(ceilings, hide_index=True, key="sweep_ceilings")


def show_verdicts() -> None:
    """The sweeps' verdicts against the issue's goals, with their deciding intervals (when the JSONs have them)."""
    verdicts, problems = sweep_data.load_verdicts()
    for p in problems:
        st.warning(p)
    if verdicts.empty:
        return
    st.subheader("Verdicts against the goals")
    st.caption(
        "Per goal and cell: met only when the whole 95 % interval of joint's gain clears the goal; the stricter "
        "verdict (mixed) compares the same metric with the split best on that metric alone."
    )
    st.dataframe(verdicts, hide_index=True, key="sweep_verdicts")


def anatomy_bars(parts: pd.DataFrame) -> alt.Chart:
    """Stacked bars of the TPOT parts, one bar per run kind, one panel per cell (wrapping)."""
    names = list(parts.sort_values("part_rank")["part_label"].unique())  # the order the sweep's JSON gives
    runs = list(parts.sort_values("run_rank")["run_label"].unique())
    bars = (
        alt.Chart(parts)
        .mark_bar()
        .encode(
            x=alt.X("run_label:N", title=None, sort=runs),
            y=alt.Y("sum(ms):Q", title="ms per token"),
            color=alt.Color("part_label:N", title="part", sort=names, legend=alt.Legend(orient="bottom")),
            order=alt.Order("part_rank:Q"),
            tooltip=["cell", "run_label", "part_label", alt.Tooltip("ms:Q", format=".2f")],
        )
        .properties(width=alt.Step(28), height=180)
    )
    return bars.facet(facet=alt.Facet("cell:N", title="workload @ RAM"), columns=5)
