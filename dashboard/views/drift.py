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
FAIL_COLOUR = "#d1495b"  # gate failures only: no policy series uses it
POLICY_COLOURS = ("#4c78a8", "#54a24b", "#f58518", "#72b7b2", "#b279a2", "#9d755d", "#bab0ac", "#eeca3b")


def _time_x() -> alt.X:
    """Run start time on a UTC axis with 24-hour labels, padded so the newest point is not clipped."""
    axis = alt.Axis(format="%m-%d %H:%M", labelAngle=-30, title="run started (UTC, 24 h)")
    return alt.X("started_at:T", axis=axis, scale=alt.Scale(type="utc", padding=24))


def _policy_colour() -> alt.Color:
    return alt.Color("policy:N", title="policy", scale=alt.Scale(range=list(POLICY_COLOURS)))


def _kl_chart(df: pd.DataFrame) -> alt.LayerChart:
    long = df.melt(id_vars=["run_id", "started_at", "policy"], value_vars=["mean_kl", "p99_kl"], var_name="statistic")
    long["value"] = long["value"].clip(lower=TINY_KL)
    long["statistic"] = long["statistic"].map({"mean_kl": "mean KL", "p99_kl": "p99 KL"})
    x = _time_x()
    y = alt.Y("value:Q", scale=alt.Scale(type="log"), title="KL against the exact baseline (nats, log)")
    stat = alt.Shape("statistic:N", title="statistic", scale=alt.Scale(range=["circle", "square"]))
    lines = (
        alt.Chart(long)
        .mark_line(point=alt.OverlayMarkDef(size=60, filled=True))
        .encode(
            x=x,
            y=y,
            color=_policy_colour(),
            strokeDash=alt.StrokeDash("statistic:N", title="statistic"),
            shape=stat,
            tooltip=list(long.columns),
        )
    )
    floor = df.dropna(subset=["numeric_floor_kl"]).assign(floor=lambda d: d["numeric_floor_kl"].clip(lower=TINY_KL))
    floor_line = (
        alt.Chart(floor)
        .mark_line(color="gray", strokeDash=[2, 2])
        .encode(x=x, y=alt.Y("floor:Q"), tooltip=["run_id:O", "numeric_floor_kl:Q"])
    )
    fails = df[df["verdict"] == "fail"].assign(
        value=lambda d: d["mean_kl"].clip(lower=TINY_KL),
        link=lambda d: "./?page=request&run=" + d["run_id"].astype(str),
    )
    alerts = (
        alt.Chart(fails)
        .mark_point(shape="triangle-up", size=220, color=FAIL_COLOUR, filled=True, cursor="pointer")
        .encode(
            x=x,
            y=alt.Y("value:Q"),
            href="link:N",  # a failure marker opens the run's drill-down
            tooltip=["run_id:O", "policy:N", "verdict:N", "mean_kl:Q"],
        )
    )
    return alt.layer(lines, floor_line, alerts)


def _agreement_chart(df: pd.DataFrame) -> alt.Chart:
    long = df.melt(id_vars=["run_id", "started_at", "policy"], value_vars=["top1_agreement", "ppl_ratio"])
    long["variable"] = long["variable"].map({"top1_agreement": "top-1 agreement", "ppl_ratio": "PPL ratio"})
    return (
        alt.Chart(long)
        .mark_line(point=True)
        .encode(
            x=_time_x(),
            y=alt.Y("value:Q", scale=alt.Scale(zero=False), title=None),
            color=_policy_colour(),
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
    st.caption(
        "Circles: mean KL, squares: p99 KL. Dashed gray: numeric floor (max KL of each run's exact-vs-exact "
        "control). Red triangles (a colour no policy uses): the gate failed; click one for the run's drill-down."
    )
    st.subheader("Top-1 agreement and perplexity ratio")
    st.altair_chart(_agreement_chart(df), width="stretch")
    st.caption(
        "PPL ratio = PPL(engine) / PPL(exact) over the tokens the engine emitted. Both score the engine's own "
        "tokens, so a broken run that emits tokens it finds likely can show a ratio below 1: read it with the KL."
    )
    st.dataframe(df[list(TABLE)], column_config=TABLE, hide_index=True, key="drift_runs")
