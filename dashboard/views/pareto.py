"""Quality cost against speed: measured TPOT against audited KL, per run and request class."""

from __future__ import annotations

import streamlit as st

from fallbackgate.dashboard import charts, data
from fallbackgate.ledger.dashboard_queries import RunFilter

COLUMNS = {
    "run_id": st.column_config.NumberColumn("run"),
    "policy": "policy",
    "request_class": "class",
    "tpot_ms": st.column_config.NumberColumn("TPOT (ms, measured)", format="%.1f"),
    "ttft_ms": st.column_config.NumberColumn("TTFT (ms, measured)", format="%.1f"),
    "mean_kl": st.column_config.NumberColumn("mean KL (nats)", format="%.3g"),
    "worst_mean_kl": st.column_config.NumberColumn("worst request's mean KL", format="%.3g"),
    "tpot_slo_ms": st.column_config.NumberColumn("TPOT SLO (ms)", format="%g"),
    "budget_mean_kl": st.column_config.NumberColumn("mean-KL budget", format="%g"),
    "requests": "requests",
    "audited": "audited",
}


def render(url: str, f: RunFilter) -> None:
    """Draw the Pareto page."""
    st.header("Quality cost against speed")
    df = data.pareto(url, f)
    if df.empty:
        st.info("No runs match the filters.")
        return
    within = df[
        (df["tpot_slo_ms"].isna() | (df["tpot_ms"] <= df["tpot_slo_ms"]))
        & (df["budget_mean_kl"].isna() | (df["mean_kl"] <= df["budget_mean_kl"]))
    ]
    cols = st.columns(3)
    cols[0].metric("Runs", df["run_id"].nunique())
    cols[1].metric("Run × class points", len(df))
    cols[2].metric("Within SLO and budget", len(within))
    st.altair_chart(charts.pareto_chart(df), width="stretch")
    st.caption(
        "Each point is one run's requests of one class: measured (wall-clock) time per output token against "
        "the mean KL its audited requests measured against the exact baseline. Down and left is better; dashed "
        "lines are each class's TPOT SLO (vertical; not drawn beyond 10x the slowest point) and mean-KL budget "
        "(horizontal). Exact runs (KL ~1e-14) are drawn at 1e-12."
    )
    st.dataframe(df[list(COLUMNS)], column_config=COLUMNS, hide_index=True, key="pareto_points")
