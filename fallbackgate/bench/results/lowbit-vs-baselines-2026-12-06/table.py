"""python fallbackgate/bench/results/lowbit-vs-baselines-2026-12-06/table.py

The README's table: per cell, joint as shipped (A, C) and joint with lowbit_colder admission and the best-effort
budget opened (B, D), each against the same partners (A's, C's): gains over the chosen static split and two LRUs,
the admission's paired gain over the shipped joint, its audited quality."""

import json
import pathlib

from fallbackgate.sweep.summary import INDEPENDENT, summarise
from fallbackgate.sweep.variant import combine

HERE = pathlib.Path(__file__).parent


def pct(iv: dict) -> str:
    return f"{100 * iv['mean']:+.0f} [{100 * iv['lo']:+.0f}, {100 * iv['hi']:+.0f}]"


def main() -> None:
    print("| cell | bytes read vs chosen static: shipped / admission | SLO vs chosen static: shipped / admission "
          "| P99 TPOT vs two LRUs: shipped / admission | admission vs shipped joint: SLO / P99 TPOT "
          "| admission's mean KL (worst run), low-bit uses per run |")  # fmt: skip
    print("|" + "---|" * 6)
    for base_name, variant_name in (("A", "B"), ("C", "D")):
        base = json.loads((HERE / f"{base_name}.json").read_text())
        combined = combine(base, json.loads((HERE / f"{variant_name}.json").read_text()), (base_name, variant_name))
        shipped = summarise(base["points"], base["config"]["held_out_seed"])["comparisons"]
        for key, c in combined["summary"]["comparisons"].items():
            g, s, q = c["gains"], shipped[key]["gains"], combined["joint_quality"][key]
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


if __name__ == "__main__":
    main()
