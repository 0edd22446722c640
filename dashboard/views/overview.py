"""Overview: runs with policy, model, verdict, SLO attainment and tag mix by exactness."""

from __future__ import annotations

import streamlit as st

from fallbackgate.dashboard import charts, data
from fallbackgate.ledger.dashboard_queries import RunFilter

COLUMNS = {
    "link": st.column_config.LinkColumn("open", display_text="drill-down", help="the run's requests, step by step"),
    "run_id": st.column_config.NumberColumn("run"),
    "started_at": st.column_config.DatetimeColumn("started (UTC)"),
    "policy": "policy",
    "controller": "controller",
    "mode": "mode",
    "model": "model",
    "status": "status",
    "verdict": "verdict",
    "requests": "requests",
    "slo_attainment": st.column_config.NumberColumn("SLO attainment (measured)", format="percent"),
    "slo_attainment_modeled": st.column_config.NumberColumn("SLO attainment (modeled)", format="percent"),
    "objects_exact": "exact objects",
    "objects_equivalent": "equivalent objects",
    "objects_approximate": "approximate objects",
    "share_approximate": st.column_config.NumberColumn("approximate share", format="percent"),
}


def render(url: str, f: RunFilter) -> None:
    """Draw the Overview page."""
    st.header("Overview")
    df = data.overview(url, f)
    if df.empty:
        st.info("No runs match the filters.")
        return
    failed = int((df["verdict"] == "fail").sum())
    cols = st.columns(4)
    cols[0].metric("Runs", len(df))
    cols[1].metric("Gate failures", failed)
    cols[2].metric("Requests", int(df["requests"].sum()))
    cols[3].metric("Approximate objects", int(df["objects_approximate"].sum()))
    df = df.assign(link=[f"./?page=request&run={run_id}" for run_id in df["run_id"]])
    st.dataframe(df[list(COLUMNS)], column_config=COLUMNS, hide_index=True, key="overview_runs")
    st.caption(
        "SLO attainment: share of requests with an SLO whose TTFT and TPOT met it; verdict: the newest "
        "run-level gate verdict recorded (`fallbackgate gate --record`), blank when none was recorded."
    )
    mix = df.melt(
        id_vars=["run_id"],
        value_vars=[f"objects_{e}" for e in data.EXACTNESS_NAMES],
        var_name="exactness",
        value_name="objects",
    )
    mix["exactness"] = mix["exactness"].str.removeprefix("objects_")
    left, right = st.columns(2)
    left.subheader("Tag mix by exactness")
    left.altair_chart(charts.exactness_bars(mix), width="stretch")
    right.subheader("Objects per tag")
    right.altair_chart(charts.tag_bars(data.tag_mix(url, f)), width="stretch")
