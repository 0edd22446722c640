"""Budget-sweep results for the Budget sweep page: from the ledger when ``fallbackgate.ledger.queries`` offers
``sweep_points`` (the sweep command's table), else from JSON files named by ``$FALLBACKGATE_SWEEP_JSON``
(a file, a directory of ``*.json`` files, or several paths separated by ``os.pathsep``).

A JSON file holds a list of points, or an object with a ``points`` or ``results`` list. A point has
``controller``, an expert budget (``expert_budget_mb``, ``expert_budget``, ``expert_mb`` or
``expert_budget_bytes``), a KV budget (``kv_budget_mb``, ``kv_budget``, ``kv_mb`` or ``kv_budget_bytes``)
and numeric metrics, at top level or under ``metrics``.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from fallbackgate.ledger import queries
from fallbackgate.ledger.db import Ledger

ENV_SWEEP = "FALLBACKGATE_SWEEP_JSON"
EXPERT_KEYS = ("expert_budget_mb", "expert_budget", "expert_mb", "expert_budget_bytes")
KV_KEYS = ("kv_budget_mb", "kv_budget", "kv_mb", "kv_budget_bytes")


def sweep_paths(setting: str | None = None) -> list[Path]:
    """The JSON files named by ``setting`` (default ``$FALLBACKGATE_SWEEP_JSON``); directories expand to *.json."""
    raw = setting if setting is not None else os.environ.get(ENV_SWEEP, "")
    out: list[Path] = []
    for part in filter(None, raw.split(os.pathsep)):
        p = Path(part).expanduser()
        out.extend(sorted(p.glob("*.json")) if p.is_dir() else [p])
    return out


def read_doc(path: Path) -> Any:
    """The parsed JSON of `path`, parsed once per version of the file (the page reads each file for its points
    and its anatomy, on every rerun); raises OSError or ValueError. Callers must not change what it returns."""
    stat = path.stat()
    return _parsed(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _parsed(path: str, mtime_ns: int, size: int) -> Any:
    """The JSON at `path` as parsed at this version (modification time and size: the cache key)."""
    return json.loads(Path(path).read_text())


def _points(doc: Any) -> list[dict[str, Any]]:
    if isinstance(doc, dict):
        doc = doc.get("points", doc.get("results"))
    if not isinstance(doc, list):
        raise ValueError("expected a list of points, or an object with a 'points' or 'results' list")
    return [p for p in doc if isinstance(p, dict)]


def _flatten(point: dict[str, Any]) -> dict[str, Any]:
    flat = {k: v for k, v in point.items() if k != "metrics"}
    if isinstance(point.get("metrics"), dict):
        flat.update(point["metrics"])
    return flat


def normalise(rows: list[dict[str, Any]], source: str) -> pd.DataFrame:
    """Points as a frame with ``controller``, ``expert_budget``, ``kv_budget``, ``source`` and metrics."""
    df = pd.DataFrame([_flatten(r) for r in rows])
    if df.empty:
        return df
    expert = next((k for k in EXPERT_KEYS if k in df), None)
    kv = next((k for k in KV_KEYS if k in df), None)
    if expert is None or kv is None or "controller" not in df:
        raise ValueError(f"points need 'controller', one of {EXPERT_KEYS} and one of {KV_KEYS}")
    df = df.rename(columns={expert: "expert_budget", kv: "kv_budget"})
    df["budget_unit"] = "MB" if expert.endswith("mb") else ("bytes" if expert.endswith("bytes") else "")
    df["source"] = source
    return df


def load_sweep(ledger: Ledger | None, setting: str | None = None) -> tuple[pd.DataFrame, list[str]]:
    """All sweep points (ledger first, then JSON files) and one message per source that could not be read."""
    frames: list[pd.DataFrame] = []
    problems: list[str] = []
    reader = getattr(queries, "sweep_points", None)
    if ledger is not None and reader is not None:
        try:
            frames.append(normalise(reader(ledger), "ledger"))
        except Exception as exc:  # noqa: BLE001 - shown to the user, never a traceback
            problems.append(f"ledger sweep table: {exc}")
    for path in sweep_paths(setting):
        try:
            frames.append(normalise(_points(read_doc(path)), str(path)))
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: {exc}")
    frames = [f for f in frames if not f.empty]
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), problems


PREFERRED_METRICS = ("tpot_mean_ms", "mean_kl", "slo_attainment", "tokens_per_s")  # shown first, in this order


def metric_columns(df: pd.DataFrame) -> list[str]:
    """Numeric columns a heatmap can colour by (not the budgets, run ids or seeds), the most telling first."""
    skip = {"expert_budget", "kv_budget", "seed"}
    numeric = [
        c
        for c in df.columns
        if c not in skip and not c.endswith("_id") and pd.api.types.is_numeric_dtype(df[c])
    ]
    first = [m for m in PREFERRED_METRICS if m in numeric]
    return first + [c for c in numeric if c not in first]


def _docs(setting: str | None) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Each named sweep JSON that reads as an object (the others are reported by :func:`load_sweep`)."""
    for path in sweep_paths(setting):
        try:
            doc = read_doc(path)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            yield path, doc


def load_anatomy(setting: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """From every sweep JSON with an ``anatomy`` (``fallbackgate sweep``): the slowest requests' TPOT parts, one row
    per (source, cell, run, part) with ``ms`` per token; per (source, cell, partner) the stall ceiling beside
    joint's P99 TPOT gain (means and 95 % bounds, in %); and one message per file whose anatomy could not be read.
    Files without one add nothing; unreadable files are reported by :func:`load_sweep`."""
    parts: list[dict[str, Any]] = []
    ceilings: list[dict[str, Any]] = []
    problems: list[str] = []
    for path, doc in _docs(setting):
        anatomy = doc.get("anatomy")
        try:
            for cell, data in (anatomy or {}).items():
                parts += _parts(str(path), cell, data)
                ceilings += _ceilings(str(path), cell, data)
        except (AttributeError, TypeError, ValueError) as exc:
            problems.append(f"{path}: its anatomy is malformed ({exc})")
    parts_df = pd.DataFrame(parts).dropna(subset=["ms"]) if parts else pd.DataFrame()
    return parts_df, pd.DataFrame(ceilings), problems


def _parts(source: str, cell: str, data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (run, part) in the order the cell names them (``runs``, ``parts``: name -> label)."""
    runs, names = data.get("runs"), data.get("parts")
    if not isinstance(runs, dict) or not isinstance(names, dict):
        raise ValueError(f"cell {cell} names no parts and runs (written before they were kept): rerun "
                         f"`python -m fallbackgate.sweep.anatomy {source} --ledger URL`")  # fmt: skip
    rows = []
    for run_rank, (run, run_label) in enumerate(runs.items()):
        means = data.get("mean", {}).get(run) or {}
        for rank, (part, label) in enumerate(names.items()):
            rows.append({"source": source, "cell": cell, "run": run, "run_label": run_label, "run_rank": run_rank,
                         "part": part.removesuffix("_ms"), "part_label": label, "part_rank": rank,
                         "ms": means.get(f"p99_request_{part}")})  # fmt: skip
    return rows


def load_verdicts(setting: str | None = None) -> tuple[pd.DataFrame, list[str]]:
    """From every sweep JSON with a ``summary`` (``fallbackgate sweep``, ``python -m fallbackgate.sweep.merge``): one
    row per (source, goal, cell, metric) with the verdict, the stricter one where the summary has it, and the
    deciding interval of joint's gain in %; and one message per file whose verdicts could not be read."""
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for path, doc in _docs(setting):
        verdicts = (doc.get("summary") or {}).get("verdicts")
        try:
            for goal, cells in (verdicts or {}).items():
                for cell, v in cells.items():
                    rows += _verdict_rows(str(path), goal, cell, v)
        except (AttributeError, TypeError, KeyError) as exc:
            problems.append(f"{path}: its verdicts are malformed ({exc})")
    return pd.DataFrame(rows), problems


def _verdict_rows(source: str, goal: str, cell: str, v: dict[str, Any]) -> list[dict[str, Any]]:
    """A verdict's deciding intervals: the chosen partner's, the best partner's, or both metrics' (within 5 %)."""
    deciding = v.get("chosen") or v.get("best")
    within = {"slo": "slo_attainment", "tpot_p99": "tpot_p99_ms"}  # the summary's keys for the two metrics
    intervals = [deciding] if deciding else [v[k] | {"metric": m} for k, m in within.items() if v.get(k)]
    return [{"source": source, "goal": goal, "cell": cell, "verdict": v["verdict"],
             "stricter_verdict": v.get("verdict_per_metric_best", ""), "metric": iv.get("metric", ""),
             "gain_%": _percent(iv.get("mean")), "gain_lo_%": _percent(iv.get("lo")),
             "gain_hi_%": _percent(iv.get("hi"))} for iv in intervals]  # fmt: skip


def _ceilings(source: str, cell: str, data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for partner, vs in (data.get("vs") or {}).items():
        row = {"source": source, "cell": cell, "partner": partner}
        for name in ("stall_ceiling", "joint_tpot_p99_gain"):
            iv = vs.get(name) or {}
            row |= {f"{name}_%": _percent(iv.get("mean")), f"{name}_lo_%": _percent(iv.get("lo")),
                    f"{name}_hi_%": _percent(iv.get("hi"))}  # fmt: skip
        rows.append(row)
    return rows


def _percent(value: float | None) -> float | None:
    return None if value is None else round(100.0 * value, 1)
