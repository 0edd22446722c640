"""Traces: what ``fallbackgate trace analyze`` found in each trace (co-burst, marginal value, flips, dual-miss
crossover, prediction, devices), read from the ledger's ``trace_analyses`` table."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from fallbackgate.dashboard import trace_data
from fallbackgate.ledger.dashboard_queries import RunFilter


def _one(rows: pd.DataFrame, analysis: str, metric: str, device: str | None = None) -> pd.Series | None:
    hit = rows[(rows["analysis"] == analysis) & (rows["metric"] == metric)]
    if device is not None:
        hit = hit[hit["device"] == device]
    return None if hit.empty else hit.iloc[0]


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None or pd.isna(value) else f"{value:.{digits}g}"


def _headline(rows: pd.DataFrame) -> None:
    cols = st.columns(4)
    lift, peak = _one(rows, "co_burst", "lift"), _one(rows, "co_burst", "peak_lag")
    cols[0].metric("Co-burst lift", _fmt(lift["value"]) if lift is not None else "n/a",
                   help="P(expert miss and KV miss in one step and layer) / product of the two")  # fmt: skip
    if lift is not None:
        cols[0].caption(f"95 % CI [{_fmt(lift['ci_low'])}, {_fmt(lift['ci_high'])}]")
    cols[1].metric("Peak lag (steps)", _fmt(peak["value"]) if peak is not None else "n/a")
    measured = rows.loc[rows["device"] != "", "device"].iloc[0] if (rows["device"] != "").any() else ""
    flips, winner = (
        _one(rows, "flips", "num_flips", measured),
        _one(rows, "marginal_value", "next_gib_to_experts", measured),
    )
    cols[2].metric(f"Best-split flips ({measured or 'n/a'})", _fmt(flips["value"]) if flips is not None else "n/a")
    cols[3].metric("Next GiB to", (winner["params"] or {}).get("winner", "n/a") if winner is not None else "n/a")


def _cross_correlation(rows: pd.DataFrame) -> alt.LayerChart:
    corr = rows[rows["metric"] == "cross_correlation"].copy()
    corr["lag"] = [p["lag"] for p in corr["params"]]
    base = alt.Chart(corr[["lag", "value", "ci_low", "ci_high"]]).encode(x=alt.X("lag:Q", title="lag (steps)"))
    band = base.mark_area(opacity=0.3).encode(y=alt.Y("ci_low:Q", title="cross-correlation"), y2="ci_high:Q")
    return alt.layer(band, base.mark_line(point=True).encode(y="value:Q", tooltip=["lag", "value"]))


def _best_share(rows: pd.DataFrame) -> alt.Chart:
    share = rows[(rows["analysis"] == "flips") & (rows["metric"] == "best_expert_share")].copy()
    share["first_step"] = [p["first_step"] for p in share["params"]]
    return (
        alt.Chart(share[["first_step", "value", "device"]])
        .mark_line(interpolate="step-after", point=True)
        .encode(x=alt.X("first_step:Q", title="window start (step)"),
                y=alt.Y("value:Q", title="best expert share", scale=alt.Scale(domain=[0, 1])),
                color="device:N", tooltip=["device", "first_step", "value"])
    )  # fmt: skip


def render(url: str, _f: RunFilter) -> None:
    """Draw the Traces page."""
    st.header("Traces")
    traces = trace_data.analysed_traces(url)
    if traces.empty:
        st.info("No analysed traces in this ledger. Run `fallbackgate trace analyze TRACE... --out DIR --ledger URL`.")
        return
    labels = {p: f"{w} ({p})" for p, w in zip(traces["trace_path"], traces["workload"], strict=True)}
    wanted = st.query_params.get("trace")
    paths = list(labels)
    path = st.selectbox("Trace", paths, index=paths.index(wanted) if wanted in paths else 0,
                        format_func=labels.get, key="trace")  # fmt: skip
    st.query_params["trace"] = path
    rows = trace_data.trace_rows(url, path)
    _headline(rows)
    left, right = st.columns(2)
    if (rows["metric"] == "cross_correlation").any():
        left.subheader("Expert and KV misses, lagged")
        left.altair_chart(_cross_correlation(rows), width="stretch")
    if (rows["metric"] == "best_expert_share").any():
        right.subheader("Best static split per window")
        right.altair_chart(_best_share(rows), width="stretch")
    for analysis in rows["analysis"].unique():
        shown = rows[rows["analysis"] == analysis][["metric", "device", "value", "ci_low", "ci_high", "unit", "params"]]
        shown = shown.assign(params=shown["params"].map(lambda p: ", ".join(f"{k}={v}" for k, v in (p or {}).items())))
        with st.expander(f"{analysis} ({len(shown)} numbers)"):
            st.dataframe(shown, hide_index=True, key=f"trace_{analysis}")
