"""python first_token_writes.py SWEEP_JSON LEDGER_URL_PATH [--workload multi-turn --ram-frac 0.25]

Why joint's first tokens were late on multi-turn@0.25 (stop 46): each request's first-token step in every run
of the cell, read from the sweep's ledger (sqlite file path), paired by (seed, turn) with the same step of each
partner. Per partner: mean non-stall time (step wall time minus `transfer_exposed_s`) and joint's excess over
it (mean ± 1.96 standard errors), the share of the steps that wrote KV to disk (`kv_copies`, action written,
tier disk) and their KiB; then joint's excess over the chosen static split (KV 0.3) split by whether joint's
step wrote KV.
"""

from __future__ import annotations

import argparse
import json
import sqlite3

import numpy as np

FIRST_TOKEN_STEPS = """select distinct sr.step_id from step_requests sr where sr.run_id=? and sr.is_sampled=1 and
  sr.step_id=(select min(step_id) from step_requests x where x.run_id=sr.run_id and x.request_id=sr.request_id
  and x.is_sampled=1) order by 1"""


def first_token_steps(db: sqlite3.Connection, run_id: int) -> list[tuple[float, float, float]]:
    """Per first-token step in order: wall ms, expert stall ms, KV bytes written to disk."""
    out = []
    for (step_id,) in db.execute(FIRST_TOKEN_STEPS, (run_id,)):
        wall, exposed = db.execute(
            "select wall_s, transfer_exposed_s from steps where run_id=? and step_id=?", (run_id, step_id)
        ).fetchone()
        (written,) = db.execute(
            "select coalesce(sum(num_bytes), 0) from kv_copies where run_id=? and step_id=? and action='written'"
            " and tier='disk'",
            (run_id, step_id),
        ).fetchone()
        out.append((wall * 1e3, (exposed or 0.0) * 1e3, float(written)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("sweep")
    p.add_argument("ledger")
    p.add_argument("--workload", default="multi-turn")
    p.add_argument("--ram-frac", type=float, default=0.25)
    args = p.parse_args()
    db = sqlite3.connect(args.ledger)
    steps: dict[tuple, dict[tuple[int, int], tuple[float, float, float]]] = {}
    for point in json.load(open(args.sweep))["points"]:
        if point["workload"] == args.workload and point["ram_frac"] == args.ram_frac:
            rows = first_token_steps(db, point["run_id"])
            by_turn = steps.setdefault((point["controller"], point["kv_share"]), {})
            by_turn.update({(point["seed"], i): row for i, row in enumerate(rows)})
    joint = steps[("joint", None)]

    def excess(partner: dict, keys: list) -> str:
        d = np.array([joint[k][0] - joint[k][1] - (partner[k][0] - partner[k][1]) for k in keys])
        return f"{d.mean():+.2f} ± {1.96 * d.std(ddof=1) / len(d) ** 0.5:.2f} ms (n={len(d)})"

    for key, partner in sorted(steps.items(), key=str):
        common = [k for k in partner if k in joint]
        nonstall = np.mean([partner[k][0] - partner[k][1] for k in common])
        wrote = np.mean([partner[k][2] > 0 for k in common])
        kib = np.mean([partner[k][2] for k in common]) / 1024
        print(f"{key}: non-stall {nonstall:.2f} ms; joint's excess {excess(partner, common)}; "
              f"steps writing KV {wrote:.2f}, {kib:.1f} KiB per step")  # fmt: skip
    static = steps[("static_split", 0.3)]
    for is_writing in (True, False):
        keys = [k for k in joint if k in static and (joint[k][2] > 0) == is_writing]
        what = "wrote" if is_writing else "wrote no"
        print(f"joint's step {what} KV: excess over static KV 0.3 {excess(static, keys)}")


if __name__ == "__main__":
    main()
