"""python ab_joint.py OUT.json LEDGER_PATH SEEDS [CONTROLLERS]

    python3 -m venv old && old/bin/pip install torch==2.13.0 ./checkout-at-1136b3e   # the code before stop 47
    for seed in 60 61 62 63 64 65; do   # interleaved, the order alternating seed by seed
      old/bin/python ab_joint.py old-$seed.json old.sqlite $seed; .venv/bin/python ab_joint.py new-$seed.json ...
    done
    python -m fallbackgate.bench.joint_ab joint-old-seeds60-65.json joint-new-seeds60-65.json \\
        --metrics ttft_p50_ms,tpot_p99_ms,slo_attainment,stall_s,read_bytes,wall_s

Stop 47's A/B of the joint controller before and after a layer's loads asked for their room once (and the
joint controller's walks were trimmed): joint alone on every workload at RAM 0.25 and 0.5 of the sweep's grid,
against the SLO targets of ``sweep_results/seeds40-49`` (no reference run), with whichever ``fallbackgate`` the
interpreter imports (the old one installed from a checkout of ``1136b3e`` in its own venv, the new one this
repository's), on the checkpoint at $FALLBACKGATE_AB_MODEL (default: this repository's bundled one, so both
read the same file). The per-seed files were pooled into the two JSONs beside this script (``points`` only).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import fallbackgate.sweep.regime as regime
from fallbackgate.ledger.db import open_ledger

HERE = pathlib.Path(__file__).resolve().parent
SWEEP_RESULTS = HERE.parents[1] / "sweep_results"
WORKLOADS = ("mixed", "short-chat", "long-retrieval", "multi-turn", "long-reasoning")


def main() -> None:
    out, ledger_path, seeds = sys.argv[1], sys.argv[2], tuple(int(s) for s in sys.argv[3].split(","))
    controllers = tuple((sys.argv[4] if len(sys.argv) > 4 else "joint").split(","))
    references = json.loads((SWEEP_RESULTS / "seeds40-49" / "sweep.json").read_text())["slo_references"]
    model = os.environ.get("FALLBACKGATE_AB_MODEL", str(HERE.parents[2] / "tinymoe" / "checkpoint"))
    lowbit = pathlib.Path(ledger_path).parent / "lowbit"
    lowbit.mkdir(exist_ok=True)
    cfg = regime.RegimeConfig(
        model_dir=model, workloads=WORKLOADS, seeds=seeds, controllers=controllers,
        slo_from={k: references[k] for k in WORKLOADS}, lowbit_dir=str(lowbit),
    )  # fmt: skip
    result = regime.run_regime(cfg, open_ledger(f"sqlite:///{ledger_path}"), log=lambda line: print(line, flush=True))
    result["fallbackgate_file"] = regime.__file__
    pathlib.Path(out).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
