"""Calibration: predicted against measured quality cost, per tag and layer."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from fallbackgate.dashboard import charts, data
from fallbackgate.ledger.dashboard_queries import RunFilter

TABLE = {
    "tag": "tag",
    "layer": "layer",
    "pairs": "pairs",
    "mean_predicted": st.column_config.NumberColumn("mean predicted cost", format="%.3e"),
    "mean_measured_kl": st.column_config.NumberColumn("mean measured KL", format="%.3e"),
    "measured_over_predicted": st.column_config.NumberColumn("measured / predicted", format="%.3g"),
    "scale": st.column_config.NumberColumn("fitted scale", format="%.3g"),
}
TOOLTIP = [f"{c}:{'N' if c == 'tag' else 'O' if c == 'layer' else 'Q'}" for c in TABLE]  # typed: frames may be empty


TINY = 1e-12  # zero has no place on a log axis: drawn here


def _scatter(df: pd.DataFrame) -> alt.LayerChart:
    pts = df.dropna(subset=["mean_measured_kl"]).copy()
    pts["predicted_shown"] = pts["mean_predicted"].clip(lower=TINY)
    pts["measured_shown"] = pts["mean_measured_kl"].clip(lower=TINY)
    low = float(min(pts["predicted_shown"].min(), pts["measured_shown"].min()))
    top = float(max(pts["predicted_shown"].max(), pts["measured_shown"].max(), 10 * low))
    diag = pd.DataFrame({"x": [low, top], "y": [low, top]})
    log = alt.Scale(type="log")
    dots = (
        alt.Chart(pts)
        .mark_circle(size=90)
        .encode(
            x=alt.X("predicted_shown:Q", title="predicted cost (nats, mean per step, log)", scale=log),
            y=alt.Y("measured_shown:Q", title="measured KL (nats, mean per position, log)", scale=log),
            color=alt.Color("tag:N", scale=charts.tag_scale()),
            tooltip=TOOLTIP,
        )
    )
    diagonal = alt.Chart(diag).mark_line(color="gray", strokeDash=[4, 4]).encode(x=alt.X("x:Q", scale=log), y="y:Q")
    return alt.layer(diagonal, dots)


def _heatmap(df: pd.DataFrame) -> alt.Chart:
    return (
        alt.Chart(df.dropna(subset=["mean_measured_kl"]))
        .mark_rect()
        .encode(
            x=alt.X("layer:O"),
            y=alt.Y("tag:N"),
            color=alt.Color("mean_measured_kl:Q", title="mean measured KL"),
            tooltip=TOOLTIP,
        )
    )


def render(url: str, f: RunFilter) -> None:
    """Draw the Calibration page."""
    st.header("Calibration")
    df = data.calibration(url, f)
    if df.empty:
        st.info(
            "No calibration data: no approximate tag (expert_defer, expert_lowbit, kv_dequant) landed on an "
            "audited position in the filtered runs, and no fitted scales are recorded. Record runs with approximate "
            "tags, then run `fallbackgate calibrate --ledger URL` to fit the predictor's scales."
        )
        return
    cols = st.columns(3)
    cols[0].metric("Tag × layer cells", int(df["pairs"].notna().sum()))
    cols[1].metric("Pairs", int(df["pairs"].fillna(0).sum()))
    cols[2].metric("Fitted scales", int(df["scale"].notna().sum()))
    left, right = st.columns(2)
    left.subheader("Predicted against measured")
    left.altair_chart(_scatter(df), width="stretch")
    right.subheader("Measured KL per tag and layer")
    right.altair_chart(_heatmap(df), width="stretch")
    st.caption(
        "Each step's approximate events per tag and layer are paired with the KL of the position it produced; "
        "points on the dashed diagonal are predicted right. Zeros are drawn at 1e-12. Refit the scales with "
        "`fallbackgate calibrate --ledger URL`."
    )
    st.dataframe(df[list(TABLE)], column_config=TABLE, hide_index=True, key="calibration_table")
