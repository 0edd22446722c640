"""The fallbackgate dashboard (Streamlit): ``fallbackgate dashboard --ledger URL`` or
``FALLBACKGATE_LEDGER=URL streamlit run dashboard/app.py``. Reads the ledger read-only.

Pages (sidebar, or ``?page=overview|pareto|compare|drift|request|calibration|sweep|traces``): Overview, Quality
vs speed (measured TPOT against audited KL), Compare runs (``&a=ID&b=ID``), Drift, Request drill-down,
Calibration, Budget sweep, Traces (``&trace=PATH``).
"""

from __future__ import annotations

from collections.abc import Callable

import streamlit as st
from sqlalchemy.exc import SQLAlchemyError

from fallbackgate.dashboard import data, filters
from fallbackgate.dashboard.views import calibration, compare, drift, drilldown, overview, pareto, sweep, traces
from fallbackgate.ledger.db import display_url

REFRESH_S = 15  # the data layer's cache lifetime too
PAGES: dict[str, tuple[str, Callable[..., None]]] = {
    "overview": ("Overview", overview.render),
    "pareto": ("Quality vs speed", pareto.render),
    "compare": ("Compare runs", compare.render),
    "drift": ("Drift", drift.render),
    "request": ("Request drill-down", drilldown.render),
    "calibration": ("Calibration", calibration.render),
    "sweep": ("Budget sweep", sweep.render),
    "traces": ("Traces", traces.render),
}


def _page() -> str:
    slugs = list(PAGES)
    wanted = st.query_params.get("page", "overview")
    index = slugs.index(wanted) if wanted in slugs else 0
    slug = st.sidebar.radio("Page", slugs, index=index, format_func=lambda s: PAGES[s][0], key="page")
    st.query_params["page"] = slug
    return slug


def main() -> None:
    """Draw the sidebar and the chosen page; ledger problems become messages, never tracebacks."""
    st.set_page_config(page_title="fallbackgate", layout="wide")
    st.sidebar.title("fallbackgate")
    slug = _page()
    url = data.ledger_url()
    try:
        ledger = data.connect(url)
        if slug == "sweep":
            sweep.render(url, data.RunFilter(), ledger)
            return
        if slug == "traces":  # traces may have no run behind them
            traces.render(url, data.RunFilter())
            return
        if not data.has_runs(url):
            st.info(f"The ledger {ledger.display_url} has no runs yet. Record one: `fallbackgate run --ledger URL`.")
            return
        run_filter = filters.sidebar_filters(url)
        is_live = st.sidebar.toggle(
            f"Auto-refresh every {REFRESH_S} s", value=st.query_params.get("refresh") == "1", key="auto_refresh"
        )
        st.query_params["refresh"] = "1" if is_live else "0"
        if is_live:  # re-run just the page on a timer; cached queries expire as often
            st.fragment(run_every=REFRESH_S)(PAGES[slug][1])(url, run_filter)
        else:
            PAGES[slug][1](url, run_filter)
    except data.LedgerError as exc:
        st.error(f"Cannot open the ledger: {exc}")
    except SQLAlchemyError as exc:
        first = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        st.error(f"Cannot read the ledger {display_url(url)}: {first[0] if first else type(exc).__name__}")
    st.sidebar.caption(f"ledger (read-only): {display_url(url)}")


main()
