"""python fallbackgate/bench/results/compression-value-2026-12-06/table.py compression_value.json ["two LRUs"]

Per device, budget and variant, over the ten cells: joint's saving over the best static split (or two LRUs;
mean over cells of each cell's seed mean), of its stall and of its whole run, and in how many cells its change
against the model as recorded is wholly below 0 / contains 0 / wholly above 0 (Student-t 95 % over the seeds);
and pooled: 1 - joint's stall over the partner's, each summed over every cell and seed (cells with a few
milliseconds of stall weigh what they save, not as much as the others)."""

import json
import sys

body = json.load(open(sys.argv[1]))
summary = body["summary"]
partner = sys.argv[2] if len(sys.argv) > 2 else "best static"


def verdicts(cells: dict, key: str) -> str:
    ivs = [c[key] for c in cells.values() if key in c]
    if not ivs:
        return "–"
    below = sum(iv["hi"] < 0 for iv in ivs)
    above = sum(iv["lo"] > 0 for iv in ivs)
    return f"{below} / {len(ivs) - below - above} / {above}"


def mean(cells: dict, key: str) -> float:
    return 100 * sum(c[key]["mean"] for c in cells.values()) / len(cells)


def pooled(cells: dict) -> float:
    joint = sum(c["n"] * c["stall_s"]["joint"] for c in cells.values())
    return 100 * (1 - joint / sum(c["n"] * c["stall_s"][partner] for c in cells.values()))


print("| device | budget | variant | stall share of joint's run | saving of stall, pooled | saving of stall "
      "| cells: change < 0 / ~0 / > 0 | saving of run time | cells: change < 0 / ~0 / > 0 |")
print("|---|---|---|---|---|---|---|---|---|")
for device, regimes in summary.items():
    for regime, variants in regimes.items():
        for variant, cells in variants.items():
            share = 100 * sum(c["stall_share_of_run"] for c in cells.values()) / len(cells)
            stall, run = mean(cells, f"saving_vs_{partner}"), mean(cells, f"run_saving_vs_{partner}")
            print(f"| {device} | {regime} | {variant} | {share:.1f} % | {pooled(cells):+.1f} % | {stall:+.1f} % | "
                  f"{verdicts(cells, f'saving_change_vs_{partner}')} | {run:+.2f} % | "
                  f"{verdicts(cells, f'run_saving_change_vs_{partner}')} |")
