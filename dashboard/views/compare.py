"""Compare two runs side by side: speed, quality, SLO attainment, verdict and the objects per tag."""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from fallbackgate.dashboard import charts, data
from fallbackgate.ledger.dashboard_queries import RunFilter

ROWS = (  # (label, source frame, column, format)
    ("policy", "overview", "policy", "{}"),
    ("model", "overview", "model", "{}"),
    ("status", "overview", "status", "{}"),
    ("verdict", "overview", "verdict", "{}"),
    ("requests", "overview", "requests", "{}"),
    ("TPOT, mean over classes (ms, measured)", "pareto", "tpot_ms", "{:.1f}"),
    ("TTFT, mean over classes (ms, measured)", "pareto", "ttft_ms", "{:.1f}"),
    ("mean KL against exact (nats)", "drift", "mean_kl", "{:.3g}"),
    ("p99 KL against exact (nats)", "drift", "p99_kl", "{:.3g}"),
    ("top-1 agreement", "drift", "top1_agreement", "{:.4f}"),
    ("SLO attainment (measured)", "overview", "slo_attainment", "{:.0%}"),
    ("approximate share of objects", "overview", "share_approximate", "{:.1%}"),
)


def _value(frames: dict[str, pd.DataFrame], source: str, column: str, run_id: int) -> Any:
    df = frames[source]
    if df.empty or column not in df:
        return None
    rows = df[df["run_id"] == run_id][column]
    if rows.empty:
        return None
    return rows.mean() if pd.api.types.is_numeric_dtype(rows) and source == "pareto" else rows.iloc[0]


def _pick(label: str, key: str, runs: list[int], default: int) -> int:
    wanted = st.query_params.get(key)
    index = runs.index(int(wanted)) if wanted is not None and wanted.isdigit() and int(wanted) in runs else default
    run_id = st.selectbox(label, runs, index=index, key=f"cmp_{key}")
    st.query_params[key] = str(run_id)
    return int(run_id)


def render(url: str, f: RunFilter) -> None:
    """Draw the Compare page."""
    st.header("Compare two runs")
    overview = data.overview(url, f)
    runs = [int(r) for r in overview["run_id"]] if not overview.empty else []
    if len(runs) < 2:
        st.info("Two runs are needed to compare; fewer match the filters.")
        return
    left, right = st.columns(2)
    with left:
        a = _pick("Run A", "a", runs, 1)
    with right:
        b = _pick("Run B", "b", runs, 0)
    frames = {"overview": overview, "pareto": data.pareto(url, f), "drift": data.drift(url, f)}
    rows = []
    for label, source, column, fmt in ROWS:
        va, vb = _value(frames, source, column, a), _value(frames, source, column, b)
        shown = [("—" if v is None or (isinstance(v, float) and pd.isna(v)) else fmt.format(v)) for v in (va, vb)]
        delta = ""
        if isinstance(va, int | float) and isinstance(vb, int | float) and not (pd.isna(va) or pd.isna(vb)):
            delta = fmt.format(vb - va) if "%" not in fmt else f"{100 * (vb - va):+.1f} pt"
        rows.append({"": label, f"run {a}": shown[0], f"run {b}": shown[1], "B − A": delta})
    st.dataframe(pd.DataFrame(rows), hide_index=True, key="compare_table")
    mix = data.tag_mix(url, f)
    mix = mix[mix["run_id"].isin([a, b])].assign(run=lambda d: "run " + d["run_id"].astype(str))
    st.subheader("Objects per tag")
    chart = (
        alt.Chart(mix)
        .mark_bar()
        .encode(
            x=alt.X("objects:Q", title="objects"),
            y=alt.Y("run:N", title=None),
            color=alt.Color("tag:N", scale=charts.tag_scale()),
            row=alt.Row("tag:N", title=None),
            tooltip=["run", "tag", "exactness", "objects"],
        )
        .properties(height=alt.Step(16))
    )
    st.altair_chart(chart, width="stretch")
