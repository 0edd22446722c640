"""What ``fallbackgate sweep`` (and the run-after-run A/B, ``bench.interleaved_ab``) read from files: class budgets,
an earlier sweep's SLO references and the demand its budgets were fractions of, each checked with a clear error
naming the file."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import yaml
from pydantic import ValidationError

from fallbackgate.policy.loader import format_errors
from fallbackgate.sweep.merge import GRID_KEYS
from fallbackgate.sweep.regime import RegimeConfig
from fallbackgate.sweep.workload import default_policy


def read_class_budgets(path: pathlib.Path | None) -> dict[str, dict[str, Any]] | None:
    """``--class-budgets``: class -> budget fields, checked by building the sweep's policy with them
    (ValueError naming the file and the field)."""
    if path is None:
        return None
    try:
        budgets = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--class-budgets {path}: {exc}") from None
    if not isinstance(budgets, dict) or not all(isinstance(v, dict) for v in budgets.values()):
        raise ValueError(f"--class-budgets {path}: expected a mapping of class name -> budget fields")
    try:
        default_policy(class_budgets=budgets)
    except ValidationError as exc:
        raise ValueError(f"--class-budgets {path}: " + "; ".join(format_errors(exc))) from None
    except ValueError as exc:
        raise ValueError(f"--class-budgets {path}: {exc}") from None
    return budgets


def earlier_references(cfg: RegimeConfig, path: pathlib.Path) -> dict[str, dict[str, Any]]:
    """The SLO references of the sweep at `path`, which must share `cfg`'s grid but for its controllers and
    cover its workloads (ValueError naming what differs)."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--slo-from {path}: {exc}") from None
    references = earlier.get("slo_references")
    if not isinstance(references, dict):
        raise ValueError(f"--slo-from {path}: no slo_references (a merged sweep has one per part: give a part's)")
    mine = json.loads(json.dumps(dataclasses.asdict(cfg)))  # as the earlier one was written: lists, not tuples
    for key in GRID_KEYS:
        theirs = earlier["config"].get(key)
        if key not in ("controllers", "workloads") and theirs != mine[key]:
            raise ValueError(f"--slo-from {path}: its {key} is {theirs!r}, this one's {mine[key]!r}")
    if earlier["config"].get("max_num_seqs", 8) != cfg.max_num_seqs:  # sweeps before it decoded 8 at most
        raise ValueError(f"--slo-from {path}: its max_num_seqs is {earlier['config'].get('max_num_seqs', 8)}, "
                         f"this one's {cfg.max_num_seqs}")  # fmt: skip
    missing = [k for k in cfg.workloads if k not in references]
    if missing:
        raise ValueError(f"--slo-from {path}: no SLO reference for {missing}")
    return {k: references[k] for k in cfg.workloads}


def read_ram_basis(cfg: RegimeConfig, path: pathlib.Path) -> dict[str, int]:
    """``--ram-basis-from``: per ``"<workload>/<seed>"`` of `cfg`, the demand (all routed experts plus the KV every
    request would hold at full length) of the sweep at `path`, so that `cfg`'s RAM fractions give that sweep's
    RAM bytes, e.g. for a smaller copy of its model (ValueError naming a workload and seed it did not run)."""
    try:
        points = json.loads(path.read_text())["points"]
        demands = {f"{p['workload']}/{p['seed']}": int(p["demand_bytes"]) for p in points}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--ram-basis-from {path}: not a sweep.json with points ({exc})") from None
    keys = [f"{w}/{s}" for w in cfg.workloads for s in cfg.seeds]
    missing = [k for k in keys if k not in demands]
    if missing:
        raise ValueError(f"--ram-basis-from {path}: no run of {', '.join(missing)} (workload/seed)")
    return {k: demands[k] for k in keys}
