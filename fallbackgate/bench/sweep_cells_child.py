"""python -m fallbackgate.bench.sweep_cells_child {reference|cell} SPEC.json OUT.json

One process of ``fallbackgate.bench.sweep_cells`` (inside the memory cgroup for ``cell``): ``reference`` is a
workload's all-in-RAM exact run (SLO targets, geometry, demand), ``cell`` one sweep cell
(:func:`fallbackgate.sweep.regime.run_cell`). Writes one JSON object to OUT.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

from fallbackgate.ledger.db import Ledger, open_ledger
from fallbackgate.sweep import regime
from fallbackgate.sweep.measures import peak_rss_bytes
from fallbackgate.sweep.workload import default_policy
from fallbackgate.workloads.tokens import ModelTokens


def reference(cfg: regime.RegimeConfig, workload: str, ledger: Ledger) -> dict[str, Any]:
    """SLO targets from the all-in-RAM exact run, and the workload's demand (all experts + its full KV)."""
    _, info = regime.sweep_policy(cfg, workload, ledger)
    specs = regime.workload_specs(cfg, workload, cfg.seeds[0])
    kv = regime.kv_demand_bytes(cfg, info["geometry"], specs)
    tokens = ModelTokens(cfg.model_dir)
    return {**info, "kv_demand_bytes": kv, "demand_bytes": info["geometry"]["expert_bytes"] + kv,
            "num_requests": len(specs), "prompt_tokens": [tokens.count(s.prompt) for s in specs]}  # fmt: skip


def cell(cfg: regime.RegimeConfig, spec: dict[str, Any], ledger: Ledger) -> dict[str, Any]:
    """One recorded, audited, gated and traced run of the cell, under the reference's SLO targets."""
    ref, point = spec["reference"], spec["cell"]
    policy = default_policy(tuple(ref["slo_tpot_ms"]), tuple(ref["slo_ttft_ms"]), step_time=cfg.step_time)
    specs = regime.workload_specs(cfg, point["workload"], point["seed"])
    return regime.run_cell(cfg, policy, specs, point, ledger)


def main(argv: list[str]) -> int:
    mode, spec_path, out_path = argv
    spec = json.loads(pathlib.Path(spec_path).read_text())
    cfg = regime.RegimeConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["config"].items()})
    ledger = open_ledger(spec["ledger"])
    try:
        out = reference(cfg, spec["workload"], ledger) if mode == "reference" else cell(cfg, spec, ledger)
    finally:
        ledger.close()
    out["peak_rss_bytes"] = peak_rss_bytes()  # a cell: since its serving started, the audit included
    pathlib.Path(out_path).write_text(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
