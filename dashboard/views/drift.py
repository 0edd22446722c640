"""Drift: KL (mean, p99), top-1 agreement and perplexity ratio over time and across runs and policies,
with the numeric floor drawn and alert markers where the gate failed."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from fallbackgate.dashboard import data
from fallbackgate.ledger.dashboard_queries import RunFilter

TABLE = {
    "run_id": st.column_config.NumberColumn("run"),
    "started_at": st.column_config.DatetimeColumn("started (UTC)"),
    "policy": "policy",
    "controller": "controller",
    "model": "model",
    "audited_requests": "audited requests",
    "positions": "positions",
    "mean_kl": st.column_config.NumberColumn("mean KL", format="%.3e"),
    "p99_kl": st.column_config.NumberColumn("p99 KL", format="%.3e"),
    "max_kl": st.column_config.NumberColumn("max KL", format="%.3e"),
    "top1_agreement": st.column_config.NumberColumn("top-1 agreement", format="%.4f"),
    "ppl_ratio": st.column_config.NumberColumn("PPL ratio", format="%.5f"),
    "numeric_floor_kl": st.column_config.NumberColumn("numeric floor KL", format="%.3e"),
    "verdict": "verdict",
}
TINY_KL = 1e-18  # KL of 0 has no place on a log axis; drawn at this value


def _kl_chart(df: pd.DataFrame) -> alt.LayerChart:
    long = df.melt(id_vars=["run_id", "started_at", "policy"], value_vars=["mean_kl", "p99_kl"], var_name="statistic")
    long["value"] = long["value"].clip(lower=TINY_KL)
    x = alt.X("started_at:T", title="run started (UTC)")
    y = alt.Y("value:Q", scale=alt.Scale(type="log"), title="KL (nats)")
    lines = (
        alt.Chart(long)
        .mark_line(point=True)
        .encode(x=x, y=y, color=alt.Color("policy:N"), strokeDash="statistic:N", tooltip=list(long.columns))
    )
    floor = df.dropna(subset=["numeric_floor_kl"]).assign(floor=lambda d: d["numeric_floor_kl"].clip(lower=TINY_KL))
    floor_line = (
        alt.Chart(floor)
        .mark_line(color="gray", strokeDash=[2, 2])
        .encode(x=x, y=alt.Y("floor:Q"), tooltip=["run_id:O", "numeric_floor_kl:Q"])
    )
    fails = df[df["verdict"] == "fail"].assign(value=lambda d: d["mean_kl"].clip(lower=TINY_KL))
    alerts = (
        alt.Chart(fails)
        .mark_point(shape="triangle-up", size=220, color="#d1495b", filled=True)
        .encode(x=x, y=alt.Y("value:Q"), tooltip=["run_id:O", "policy:N", "verdict:N", "mean_kl:Q"])
    )
    return alt.layer(lines, floor_line, alerts)


def _agreement_chart(df: pd.DataFrame) -> alt.Chart:
    long = df.melt(id_vars=["run_id", "started_at", "policy"], value_vars=["top1_agreement", "ppl_ratio"])
    return (
        alt.Chart(long)
        .mark_line(point=True)
        .encode(
            x=alt.X("started_at:T", title="run started (UTC)"),
            y=alt.Y("value:Q", scale=alt.Scale(zero=False), title=None),
            color="policy:N",
            row=alt.Row("variable:N", title=None),
            tooltip=list(long.columns),
        )
        .resolve_scale(y="independent")
        .properties(height=160)
    )


def render(url: str, f: RunFilter) -> None:
    """Draw the Drift page."""
    st.header("Drift")
    df = data.drift(url, f)
    if df.empty:
        st.info("No audited runs match the filters (drift needs per-position diffs from the auditor).")
        return
    last = df.iloc[-1]
    cols = st.columns(5)
    cols[0].metric(f"Mean KL (run {last['run_id']})", f"{last['mean_kl']:.3e}")
    cols[1].metric("p99 KL", f"{last['p99_kl']:.3e}")
    cols[2].metric("Top-1 agreement", f"{last['top1_agreement']:.4f}")
    cols[3].metric("PPL ratio", f"{last['ppl_ratio']:.5f}")
    cols[4].metric("Gate failures", int((df["verdict"] == "fail").sum()))
    st.subheader("KL against the exact baseline")
    st.altair_chart(_kl_chart(df), width="stretch")
    st.caption("Dashed gray: numeric floor (max KL of each run's exact-vs-exact control). Red triangles: gate failed.")
    st.subheader("Top-1 agreement and perplexity ratio")
    st.altair_chart(_agreement_chart(df), width="stretch")
    st.dataframe(df[list(TABLE)], column_config=TABLE, hide_index=True, key="drift_runs")
