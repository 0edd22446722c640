"""Altair chart builders shared by the pages; colours follow the exactness names and tag names."""

from __future__ import annotations

import altair as alt
import pandas as pd

from fallbackgate.dashboard.data import EXACTNESS_NAMES, TAG_ORDER

EXACTNESS_COLOURS = ("#4c9a2a", "#e0a526", "#d1495b")  # exact, equivalent, approximate
TAG_COLOURS = ("#4c9a2a", "#8fc46a", "#e0a526", "#f2cf74", "#d1495b", "#a4243b", "#6a4c93")


def exactness_scale() -> alt.Scale:
    """Colour scale over the exactness names."""
    return alt.Scale(domain=list(EXACTNESS_NAMES), range=list(EXACTNESS_COLOURS))


def tag_scale() -> alt.Scale:
    """Colour scale over the tag names (exact tags green, approximate red/purple)."""
    return alt.Scale(domain=list(TAG_ORDER), range=list(TAG_COLOURS))


def exactness_bars(df: pd.DataFrame) -> alt.Chart:
    """Stacked bars: objects per run by exactness (``df`` has run_id, exactness, objects)."""
    return (
        alt.Chart(df)
        .mark_bar()
        .encode(
            x=alt.X("run_id:O", title="run"),
            y=alt.Y("objects:Q", stack="normalize", title="share of objects"),
            color=alt.Color("exactness:N", scale=exactness_scale(), title="exactness"),
            tooltip=["run_id", "exactness", "objects"],
        )
    )


def tag_bars(df: pd.DataFrame) -> alt.Chart:
    """Stacked bars: objects per run by tag."""
    return (
        alt.Chart(df)
        .mark_bar()
        .encode(
            x=alt.X("run_id:O", title="run"),
            y=alt.Y("objects:Q", title="objects"),
            color=alt.Color("tag:N", scale=tag_scale(), title="tag"),
            tooltip=["run_id", "tag", "exactness", "objects"],
        )
    )


MAX_HEATMAP_WIDTH = 900  # pixels: a long request's steps share this width instead of overflowing the page


def tag_heatmap(grid: pd.DataFrame) -> alt.Chart:
    """Step × layer cells coloured by the least exact tag used there, one row per object kind; steps on a
    quantitative axis squeezed into MAX_HEATMAP_WIDTH pixels however long the request is."""
    num_steps = max(1, grid["step_id"].nunique()) if not grid.empty else 1
    width = min(MAX_HEATMAP_WIDTH, 18 * num_steps)
    return (
        alt.Chart(grid)
        .mark_rect()
        .encode(
            x=alt.X("step_id:O", title="step", axis=alt.Axis(labelOverlap="greedy", labelAngle=0)),
            y=alt.Y("layer:O", title="layer"),
            color=alt.Color("tag:N", scale=tag_scale(), title="least exact tag"),
            row=alt.Row("object_kind:N", title=None),
            tooltip=["step_id", "layer", "object_kind", "tag", "exactness", "objects", "cell_objects", "cell_tags"],
        )
        .properties(height=alt.Step(18), width=width)
    )


def pareto_chart(df: pd.DataFrame) -> alt.LayerChart:
    """Measured TPOT (ms, log) against audited mean KL (nats, log) per run × class, coloured by policy and
    shaped by class, with each class's TPOT SLO (vertical) and mean-KL budget (horizontal) as dashed rules."""
    tooltip = [
        "run_id:O",
        "policy:N",
        "request_class:N",
        alt.Tooltip("tpot_ms:Q", format=".1f"),
        alt.Tooltip("mean_kl:Q", format=".3g"),
        "requests:Q",
        "audited:Q",
    ]
    points = (
        alt.Chart(df)
        .mark_point(filled=True, size=90)
        .encode(
            x=alt.X("tpot_ms:Q", title="measured TPOT (ms, log)", scale=alt.Scale(type="log")),
            y=alt.Y("kl_shown:Q", title="audited mean KL (nats, log; exact at 1e-12)", scale=alt.Scale(type="log")),
            color=alt.Color("policy:N", title="policy"),
            shape=alt.Shape("request_class:N", title="class"),
            tooltip=tooltip,
        )
    )
    slo = df.dropna(subset=["tpot_slo_ms"]).drop_duplicates(["request_class", "tpot_slo_ms"])
    slo = slo[slo["tpot_slo_ms"] <= 10 * df["tpot_ms"].max()]  # a far-off SLO would flatten the points
    budget = df.dropna(subset=["budget_mean_kl"]).drop_duplicates(["request_class", "budget_mean_kl"])
    slo_rules = (
        alt.Chart(slo)
        .mark_rule(strokeDash=[4, 4], color="#666")
        .encode(x="tpot_slo_ms:Q", tooltip=["request_class:N", alt.Tooltip("tpot_slo_ms:Q", title="TPOT SLO (ms)")])
    )
    budget_rules = (
        alt.Chart(budget)
        .mark_rule(strokeDash=[2, 6], color="#666")
        .encode(
            y="budget_mean_kl:Q", tooltip=["request_class:N", alt.Tooltip("budget_mean_kl:Q", title="mean-KL budget")]
        )
    )
    return alt.layer(points, slo_rules, budget_rules).resolve_scale(x="shared", y="shared")
