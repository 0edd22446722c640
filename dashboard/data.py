"""The dashboard's data layer: opens the ledger read-only and turns ``fallbackgate.ledger.queries`` results into
DataFrames. Every aggregation runs in SQL inside those queries; this module only renames columns and
derives per-row ratios. Results are cached per (ledger URL, filter) for :data:`CACHE_TTL_S` seconds.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pandas as pd
import streamlit as st
from sqlalchemy import event

from fallbackgate.ledger import dashboard_queries, pareto_queries, queries, request_queries, vocabulary
from fallbackgate.ledger.dashboard_queries import RunFilter
from fallbackgate.ledger.db import DEFAULT_LEDGER, ENV_VAR, Ledger, LedgerError, open_ledger

CACHE_TTL_S = 15
EXACTNESS_NAMES = vocabulary.EXACTNESS_NAMES
TAG_ORDER = vocabulary.TAG_NAMES

__all__ = ["LedgerError", "RunFilter", "ledger_url", "connect"]


def ledger_url() -> str:
    """The ledger URL the app shows: ``$FALLBACKGATE_LEDGER``, else the default SQLite file."""
    return os.environ.get(ENV_VAR) or DEFAULT_LEDGER


@st.cache_resource(show_spinner=False)
def _open(url: str) -> Ledger:
    ledger = open_ledger(url, read_only=True)  # SQLite: a mode=ro file URI
    if ledger.url.get_backend_name() == "postgresql":  # PostgreSQL: every session read-only too

        @event.listens_for(ledger.engine, "connect")
        def _read_only(dbapi_conn: Any, _record: Any) -> None:
            with dbapi_conn.cursor() as cur:
                cur.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
            dbapi_conn.commit()

        ledger.engine.dispose()  # drop the connection opened before the hook
    return ledger


def connect(url: str) -> Ledger:
    """The ledger at ``url``, opened read-only once per process; raises LedgerError with a clear message."""
    return _open(url)


def _frame(rows: list[dict[str, Any]], columns: list[str] | None = None) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=columns) if rows or columns else pd.DataFrame()


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def filter_options(url: str) -> dict[str, Any]:
    """Distinct policies, models, request classes and the date range of the runs."""
    return dashboard_queries.filter_options(connect(url))


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def has_runs(url: str) -> bool:
    """Whether the ledger holds any run."""
    return queries.latest_run_id(connect(url)) is not None


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def overview(url: str, f: RunFilter) -> pd.DataFrame:
    """One row per run: policy, model, verdict, SLO attainment, objects and share per exactness."""
    df = _frame(dashboard_queries.overview_runs(connect(url), f, objects=False))
    if df.empty:
        return df
    # objects per exactness from the (cached) per-tag sums: one pass over the events serves both
    mix = tag_mix(url, f).pivot_table(index="run_id", columns="exactness", values="objects", aggfunc="sum")
    mix = mix.reindex(columns=list(EXACTNESS_NAMES), fill_value=0).add_prefix("objects_")
    df = df.join(mix, on="run_id")
    for e in EXACTNESS_NAMES:
        df[f"objects_{e}"] = df[f"objects_{e}"].fillna(0).astype(int)
    total = sum(df[f"objects_{e}"] for e in EXACTNESS_NAMES)
    for e in EXACTNESS_NAMES:
        df[f"share_{e}"] = (df[f"objects_{e}"] / total.where(total > 0)).astype(float)
    return df


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def run_ids(url: str, f: RunFilter) -> list[int]:
    """Ids of the runs passing ``f``, newest first (no pass over the events)."""
    return [int(r["run_id"]) for r in dashboard_queries.overview_runs(connect(url), f, objects=False)]


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def tag_mix(url: str, f: RunFilter) -> pd.DataFrame:
    """Objects per run × tag × exactness."""
    return _frame(dashboard_queries.tag_mix(connect(url), f), ["run_id", "tag", "exactness", "objects"])


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def drift(url: str, f: RunFilter) -> pd.DataFrame:
    """Per audited run: mean and p99 KL, top-1 agreement, perplexity ratio, numeric floor, verdict."""
    df = _frame(dashboard_queries.drift_series(connect(url), f))
    if df.empty:
        return df
    df["ppl_ratio"] = df["mean_log_ppl_ratio"].map(math.exp)
    return df


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def run_requests(url: str, run_id: int, request_classes: tuple[str, ...]) -> pd.DataFrame:
    """The requests of one run (id, class, verdict)."""
    rows = request_queries.run_request_ids(connect(url), run_id, request_classes)
    return _frame(rows, ["request_id", "request_class", "verdict"])


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def request_detail(url: str, run_id: int, request_id: str) -> dict[str, Any] | None:
    """Everything the drill-down shows for one request, or None when the run has no such request."""
    ledger = connect(url)
    summary = next((r for r in queries.request_summaries(ledger, run_id) if r["request_id"] == request_id), None)
    if summary is None:
        return None
    return {
        "summary": summary,
        "run": queries.get_run(ledger, run_id),
        "verdict": request_queries.request_verdict(ledger, run_id, request_id),
        "grid": _frame(
            request_queries.request_tag_grid(ledger, run_id, request_id),
            ["step_id", "layer", "object_kind", "tag", "exactness", "objects", "cell_objects", "cell_tags"],
        ),
        "positions": _frame(
            queries.position_diffs(ledger, run_id, request_id),
            ["position", "step_id", "token_id", "kl", "replay_kl", "top1_agree", "delta_p", "logp_exact"]
            + ["logp_engine"],
        ),
        "timeline": _frame(
            request_queries.request_step_timeline(ledger, run_id, request_id),
            ["step_id", "kind", "is_observe", "wall_s", "modeled_s", "cum_wall_s", "cum_modeled_s"]
            + ["predicted_cost", "cum_predicted_cost"],
        ),
        "exactness": request_queries.request_objects_by_exactness(ledger, run_id, request_id),
    }


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def calibration(url: str, f: RunFilter) -> pd.DataFrame:
    """Per tag × layer: pairs, mean predicted cost, mean measured KL, their ratio and the fitted scale."""
    ledger = connect(url)
    cols = ["tag", "layer", "pairs", "mean_predicted", "mean_measured_kl", "sum_predicted", "sum_measured_kl"]
    df = _frame(dashboard_queries.calibration_summary(ledger, f), cols)
    fitted = _frame(
        dashboard_queries.latest_calibrations(ledger), ["tag", "layer", "scale", "num_samples", "fitted_at"]
    )
    df = df.merge(fitted[["tag", "layer", "scale"]], on=["tag", "layer"], how="outer")
    df["measured_over_predicted"] = df["sum_measured_kl"] / df["sum_predicted"].where(df["sum_predicted"] > 0)
    return df.sort_values(["tag", "layer"], ignore_index=True)


def clear_caches() -> None:
    """Forget cached query results and connections (the benchmark measures cold renders)."""
    st.cache_data.clear()
    st.cache_resource.clear()


KL_FLOOR_SHOWN = 1e-12  # KL below this is drawn at it on a log axis (exact runs measure ~1e-14)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def pareto(url: str, f: RunFilter) -> pd.DataFrame:
    """Per run × request class: measured TPOT and TTFT in ms, audited mean KL (and the value drawn on a
    log axis), request counts, the class's TPOT SLO and mean-KL budget."""
    cols = [
        "run_id",
        "request_class",
        "policy",
        "tpot_s",
        "ttft_s",
        "mean_kl",
        "worst_mean_kl",
        "requests",
        "audited",
        "tpot_slo_ms",
        "budget_mean_kl",
    ]
    df = _frame(pareto_queries.pareto_points(connect(url), f), cols)
    if df.empty:
        return df
    df["tpot_ms"] = 1e3 * df["tpot_s"]
    df["ttft_ms"] = 1e3 * df["ttft_s"]
    df["kl_shown"] = df["mean_kl"].clip(lower=KL_FLOOR_SHOWN)
    return df.drop(columns=["tpot_s", "ttft_s"])
