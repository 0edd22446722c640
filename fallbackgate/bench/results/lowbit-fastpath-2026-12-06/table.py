"""python fallbackgate/bench/results/lowbit-fastpath-2026-12-06/table.py [A.json B.json]

Per cell, joint as shipped (A) and joint with lowbit_colder admission and the best-effort budget opened (B), each
against the same partners (A's, run in the same window): gains over the chosen static split and two LRUs, the
admission's paired gain over the shipped joint, its audited quality; then the goal verdicts of both."""

import json
import pathlib
import sys

from fallbackgate.sweep.summary import INDEPENDENT, summarise
from fallbackgate.sweep.variant import combine

HERE = pathlib.Path(__file__).parent


def pct(iv: dict) -> str:
    return f"{100 * iv['mean']:+.0f} [{100 * iv['lo']:+.0f}, {100 * iv['hi']:+.0f}]"


def main(argv: list[str]) -> None:
    a_path, b_path = (pathlib.Path(p) for p in argv) if argv else (HERE / "A.json", HERE / "B.json")
    base = json.loads(a_path.read_text())
    combined = combine(base, json.loads(b_path.read_text()), ("A", "B"))
    shipped = summarise(base["points"], base["config"]["held_out_seed"])
    print("| cell | bytes read vs chosen static: shipped / admission | SLO vs chosen static: shipped / admission "
          "| P99 TPOT vs two LRUs: shipped / admission | admission vs shipped joint: SLO / P99 TPOT "
          "| admission's mean KL (worst run), low-bit uses per run |")  # fmt: skip
    print("|" + "---|" * 6)
    for key, c in combined["summary"]["comparisons"].items():
        g, s, q = c["gains"], shipped["comparisons"][key]["gains"], combined["joint_quality"][key]
        v, vs_base = q["variant"], q["variant_gain_over_base"]
        cols = [
            (s["chosen_static"]["read_bytes"], g["chosen_static"]["read_bytes"]),
            (s["chosen_static"]["slo_attainment"], g["chosen_static"]["slo_attainment"]),
            (s[INDEPENDENT]["tpot_p99_ms"], g[INDEPENDENT]["tpot_p99_ms"]),
        ]
        cells = [f"{pct(a['all'])} / {pct(b['all'])}" for a, b in cols]
        cells.append(f"{pct(vs_base['slo_attainment'])} / {pct(vs_base['tpot_p99_ms'])}")
        cells.append(f"{v['mean_kl']:.1e} ({v['worst_mean_kl']:.1e}), {v['lowbit_experts'] / v['runs']:.0f}")
        print(f"| {key} | " + " | ".join(cells) + " |")
    print("\n| goal | cell | shipped | admission |\n|---|---|---|---|")
    for goal, cells in shipped["verdicts"].items():
        for key, verdict in cells.items():
            other = combined["summary"]["verdicts"][goal][key]
            print(f"| {goal} | {key} | {verdict['verdict']} | {other['verdict']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
