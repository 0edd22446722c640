"""The Traces page's data: what ``fallbackgate trace analyze`` stored in the ledger's ``trace_analyses`` table,
as DataFrames, cached like the rest of the dashboard's queries."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from fallbackgate.dashboard.data import CACHE_TTL_S, connect
from fallbackgate.ledger import trace_queries

ROW_COLUMNS = ["trace_path", "workload", "run_id", *trace_queries.FIELDS]


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def analysed_traces(url: str) -> pd.DataFrame:
    """One row per analysed trace, newest first."""
    rows = trace_queries.analysed_traces(connect(url))
    return pd.DataFrame(rows, columns=["trace_path", "workload", "run_id", "num_rows", "analysed_at"])


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def trace_rows(url: str, trace_path: str) -> pd.DataFrame:
    """Every stored number of one trace."""
    return pd.DataFrame(trace_queries.trace_analyses(connect(url), [trace_path]), columns=ROW_COLUMNS)
