"""The sidebar filters shared by every page: policy, model, request class and time range, kept in the URL
(``?policy=…&model=…&class=…&range=24h``) so a view can be shared as a link."""

from __future__ import annotations

import datetime as dt

import streamlit as st

from fallbackgate.dashboard import data
from fallbackgate.ledger.dashboard_queries import RunFilter

RANGES = {"all": None, "1h": dt.timedelta(hours=1), "24h": dt.timedelta(days=1), "7d": dt.timedelta(days=7)}
RANGE_LABELS = {"all": "all time", "1h": "last hour", "24h": "last 24 h", "7d": "last 7 days", "dates": "dates…"}
URL_KEYS = {"f_policy": "policy", "f_class": "class", "f_model": "model"}


def _day_start(day: dt.date | None, plus_days: int = 0) -> dt.datetime | None:
    if day is None:
        return None
    return dt.datetime.combine(day + dt.timedelta(days=plus_days), dt.time.min, tzinfo=dt.UTC)


def _from_url(key: str) -> list[str]:
    """A multiselect's initial value from the URL (first render only; then the widget owns it)."""
    return st.query_params.get_all(URL_KEYS[key]) if key not in st.session_state else st.session_state[key]


def sidebar_filters(url: str) -> RunFilter:
    """Draw the filters, mirror them into the URL and return them; values typed by the user reach SQL only
    as bound parameters."""
    raw = data.filter_options(url)
    opts = {k: [v for v in raw[k] if v is not None] for k in ("policies", "models", "request_classes")}
    side = st.sidebar
    side.header("Filters")
    picked = {}
    for key, label, choices in (
        ("f_policy", "Policy", opts["policies"]),
        ("f_model", "Model", opts["models"]),
        ("f_class", "Request class", opts["request_classes"]),
    ):
        initial = [str(v) for v in _from_url(key)]
        choices = list(dict.fromkeys([*choices, *initial]))
        picked[key] = side.multiselect(label, choices, default=initial, key=key, accept_new_options=True)
        st.query_params[URL_KEYS[key]] = [str(v) for v in picked[key]]
    wanted = st.query_params.get("range", "all")
    names = list(RANGE_LABELS)
    span = side.radio(
        "Runs started",
        names,
        index=names.index(wanted) if wanted in names else 0,
        format_func=RANGE_LABELS.get,
        key="f_range",
        horizontal=True,
    )
    st.query_params["range"] = span
    since = until = None
    if span == "dates":
        since = _day_start(side.date_input("Started on or after", value=None, key="f_since"))
        until = _day_start(side.date_input("Started on or before", value=None, key="f_until"), plus_days=1)
    elif RANGES[span] is not None:
        since = dt.datetime.now(dt.UTC) - RANGES[span]
    return RunFilter(
        policies=tuple(str(p) for p in picked["f_policy"]),
        models=tuple(str(m) for m in picked["f_model"]),
        request_classes=tuple(str(c) for c in picked["f_class"]),
        since=since,
        until=until,
    )
