"""The sidebar filters shared by every page: policy, model, request class and date range."""

from __future__ import annotations

import datetime as dt

import streamlit as st

from fallbackgate.dashboard import data
from fallbackgate.ledger.dashboard_queries import RunFilter


def _day_start(day: dt.date | None, plus_days: int = 0) -> dt.datetime | None:
    if day is None:
        return None
    return dt.datetime.combine(day + dt.timedelta(days=plus_days), dt.time.min, tzinfo=dt.UTC)


def sidebar_filters(url: str) -> RunFilter:
    """Draw the filters and return them; values typed by the user reach SQL only as bound parameters."""
    raw = data.filter_options(url)
    opts = {k: [v for v in raw[k] if v is not None] for k in ("policies", "models", "request_classes")}
    side = st.sidebar
    side.header("Filters")
    policies = side.multiselect("Policy", opts["policies"], key="f_policy", accept_new_options=True)
    models = side.multiselect("Model", opts["models"], key="f_model", accept_new_options=True)
    classes = side.multiselect("Request class", opts["request_classes"], key="f_class", accept_new_options=True)
    since = side.date_input("Started on or after", value=None, key="f_since")
    until = side.date_input("Started on or before", value=None, key="f_until")
    return RunFilter(
        policies=tuple(str(p) for p in policies),
        models=tuple(str(m) for m in models),
        request_classes=tuple(str(c) for c in classes),
        since=_day_start(since),
        until=_day_start(until, plus_days=1),
    )
