"""The sweep's verdicts across seeds: joint against the best static split and against two independent LRUs.

Per workload, RAM budget and seed the comparison partners are: the **oracle static split** (the KV share
that did best on that seed, by SLO attainment then P99 TPOT: a bound no static budgeter knows in advance),
the **chosen static split** (the one KV share with the best mean over the non-held-out seeds, then applied
to every seed, the held-out one included) and ``independent_lru``. A gain is relative: SLO attainment
``joint / partner − 1`` (partner 0: reported as the difference), P99 TPOT ``1 − joint / partner``, and the
same for read bytes and stall seconds. Intervals are Student-t 95 % over seeds (n = 3 gives wide ones).
A verdict is ``met`` only when the whole interval clears the goal, ``not met`` when it lies below it,
``undecided`` otherwise. On mixed a stricter verdict (``verdict_per_metric_best``) takes the same metric against
the split best on that metric alone (:func:`per_metric_best`), never a better one for joint. Quality is reported
beside (``quality``: joint's and the baselines' audited mean KL and whether every gate passed), not folded into
the gains.

``python -m fallbackgate.sweep.summary SWEEP.json`` recomputes the summary and the heatmaps of a results file.
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
import sys
from typing import Any

from fallbackgate.sweep.intervals import interval

STATIC, INDEPENDENT, JOINT = "static_split", "independent_lru", "joint"
VERDICT_METRICS = ("slo_attainment", "tpot_p99_ms")  # what a verdict is decided on
METRICS = (*VERDICT_METRICS, "read_bytes", "stall_s")
HIGHER_IS_BETTER = {"slo_attainment"}
GOAL_MIXED = 0.20  # joint beats the best static split on mixed by this much
GOAL_WITHIN = 0.05  # joint within this of each homogeneous workload's best static split


NO_DATA = "no data"  # a verdict without a comparison to decide it


def gain(metric: str, joint: float, partner: float) -> float:
    """Joint's relative gain over ``partner`` on ``metric`` (positive: joint better)."""
    if metric in HIGHER_IS_BETTER:
        return joint - partner if partner <= 0 else joint / partner - 1.0
    return 1.0 - joint / partner if partner > 0 else 0.0


def _rank(point: dict[str, Any]) -> tuple[float, float]:
    m = point["metrics"]
    return (-m["slo_attainment"], m["tpot_p99_ms"])


def _groups(points: list[dict[str, Any]]) -> dict[tuple[str, float], dict[int, list[dict[str, Any]]]]:
    out: dict[tuple[str, float], dict[int, list[dict[str, Any]]]] = {}
    for p in points:
        out.setdefault((p["workload"], p["ram_frac"]), {}).setdefault(p["seed"], []).append(p)
    return out


def _split_scores(by_seed: dict[int, list[dict[str, Any]]], held_out: int) -> dict[float, dict[str, float]]:
    """Per KV share, each verdict metric's mean over the non-held-out seeds, signed so that lower is better."""
    values: dict[float, dict[str, list[float]]] = {}
    for seed, cell in by_seed.items():
        for p in cell:
            if p["controller"] == STATIC and seed != held_out:
                for metric in VERDICT_METRICS:
                    values.setdefault(p["kv_share"], {}).setdefault(metric, []).append(p["metrics"][metric])
    return {share: {m: (-1.0 if m in HIGHER_IS_BETTER else 1.0) * statistics.fmean(v) for m, v in by.items()}
            for share, by in values.items()}  # fmt: skip


def _best_share(scores: dict[float, dict[str, float]], first: str) -> float | None:
    """The share best on `first`, ties broken by the other verdict metric."""
    order = (first, *(m for m in VERDICT_METRICS if m != first))
    return min(scores, key=lambda s: tuple(scores[s][m] for m in order)) if scores else None


def chosen_share(by_seed: dict[int, list[dict[str, Any]]], held_out: int) -> float | None:
    """The KV share with the best mean (SLO attainment, then P99 TPOT) over the non-held-out seeds."""
    return _best_share(_split_scores(by_seed, held_out), "slo_attainment")


def per_metric_best(by_seed: dict[int, list[dict[str, Any]]], held_out: int) -> dict[str, Any]:
    """Per verdict metric: the KV share with the best mean of that metric over the non-held-out seeds (ties: the
    other metric's mean), and joint's gain on that metric over it (interval over all seeds) — the stricter
    reading of "the best static split", which a near-tie on the other metric cannot move."""
    scores = _split_scores(by_seed, held_out)
    out: dict[str, Any] = {}
    for metric in VERDICT_METRICS if scores else ():
        share = _best_share(scores, metric)
        gains = []
        for cell in by_seed.values():
            joint = next((p for p in cell if p["controller"] == JOINT), None)
            partner = next((p for p in cell if p["controller"] == STATIC and p["kv_share"] == share), None)
            if joint and partner:
                gains.append(gain(metric, joint["metrics"][metric], partner["metrics"][metric]))
        out[metric] = {"kv_share": share, "all": interval(gains)}
    return out


def compare(by_seed: dict[int, list[dict[str, Any]]], held_out: int) -> dict[str, Any]:
    """Per partner and metric, joint's gain per seed and its interval (all seeds; held-out apart)."""
    share = chosen_share(by_seed, held_out)
    rows: dict[str, dict[str, dict[int, float]]] = {}
    quality: dict[int, dict[str, float]] = {}
    for seed, cell in sorted(by_seed.items()):
        joint = next((p for p in cell if p["controller"] == JOINT), None)
        statics = [p for p in cell if p["controller"] == STATIC]
        partners = {
            "oracle_static": min(statics, key=_rank) if statics else None,
            "chosen_static": next((p for p in statics if p["kv_share"] == share), None),
            INDEPENDENT: next((p for p in cell if p["controller"] == INDEPENDENT), None),
        }
        if joint is None:
            continue
        for name, partner in partners.items():
            if partner is None:
                continue
            for metric in METRICS:
                value = gain(metric, joint["metrics"][metric], partner["metrics"][metric])
                rows.setdefault(name, {}).setdefault(metric, {})[seed] = value
        quality[seed] = {
            "joint_mean_kl": joint["metrics"]["mean_kl"],
            "baseline_max_mean_kl": max(
                (p["metrics"]["mean_kl"] for p in cell if p["controller"] != JOINT), default=0.0
            ),
            "all_gates_passed": float(all(p["metrics"]["gate_passed"] for p in cell)),
        }
    out: dict[str, Any] = {"chosen_static_kv_share": share, "quality": quality, "gains": {},
                           "per_metric_best": per_metric_best(by_seed, held_out)}  # fmt: skip
    for name, by_metric in rows.items():
        out["gains"][name] = {
            metric: {
                "per_seed": per_seed,
                "all": interval(list(per_seed.values())),
                "held_out": per_seed.get(held_out),
            }
            for metric, per_seed in by_metric.items()
        }
    return out


def _best(gains: dict[str, Any], partner: str) -> dict[str, float]:
    """The interval (all seeds) of whichever of SLO attainment and P99 TPOT gains more on average."""
    g = gains.get(partner, {})
    found = [g[m]["all"] | {"metric": m} for m in VERDICT_METRICS if m in g]
    return max(found, key=lambda x: x["mean"]) if found else {"mean": float("nan"), "lo": float("nan"),
                                                             "hi": float("nan"), "metric": ""}  # fmt: skip


def decide(iv: dict[str, Any], goal: float) -> str:
    """``met`` when the whole interval clears ``goal``, ``not met`` when it lies below, else ``undecided``."""
    if not math.isfinite(iv["mean"]):
        return NO_DATA
    if iv["lo"] >= goal:
        return "met"
    return "not met" if iv["hi"] < goal else "undecided"


def bounds_summary(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Per controller: read bytes over FOO's LP bound, and over Belady's MIN per kind at the run's split."""
    out: dict[str, Any] = {}
    for controller in (STATIC, INDEPENDENT, JOINT):
        mine = [p["metrics"] for p in points if p["controller"] == controller]
        if not mine:
            continue
        out[controller] = {
            "read_over_foo_lb": interval([m["read_bytes"] / max(1.0, m["foo_lb_bytes"]) for m in mine]),
            "read_over_belady_per_kind": interval(
                [m["read_bytes"] / max(1.0, m["belady_expert_bytes"] + m["belady_kv_bytes"]) for m in mine]
            ),
            "expert_read_over_belady_expert": interval(
                [expert_read_bytes(m) / max(1.0, m["belady_expert_bytes"]) for m in mine]
            ),
        }
        same_room = [expert_read_bytes(m) / max(1.0, m["belady_expert_bytes_same_room"])
                     for m in mine if "belady_expert_bytes_same_room" in m]  # fmt: skip
        if same_room:  # sweeps before this bound have none
            out[controller]["expert_read_over_belady_same_room"] = interval(same_room)
    return out


def expert_read_bytes(m: dict[str, Any]) -> float:
    """A run's expert bytes read from slower tiers: every expert tag's bytes but the resident ones."""
    return sum(v for k, v in m.items() if k.startswith("bytes_expert_") and not k.endswith("_resident"))


def with_budget_fields(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each point with the expert and KV budgets the dashboard's Budget sweep page keys on
    (``expert_budget_mb``, ``kv_budget_mb``): static_split's nominal split; for the others the experts' peak
    RAM-pool share and the rest."""
    out = []
    for p in points:
        ram = p["ram_bytes"]
        if p.get("kv_share") is not None:
            expert = ram * (1.0 - p["kv_share"])
        else:
            expert = min(ram, p["metrics"].get("peak_pool_by_kind", {}).get("expert", ram))
        out.append(
            {**p, "expert_budget_mb": round(expert / 2**20, 4), "kv_budget_mb": round((ram - expert) / 2**20, 4)}
        )
    return out


def summarise(points: list[dict[str, Any]], held_out_seed: int) -> dict[str, Any]:
    """Every (workload, RAM budget)'s comparison and the three verdicts of the issue's "done when"."""
    comparisons = {f"{w}@{r}": compare(by_seed, held_out_seed) for (w, r), by_seed in sorted(_groups(points).items())}
    verdicts: dict[str, Any] = {"mixed_vs_static": {}, "vs_independent": {}, "within_static": {}}
    for key, c in comparisons.items():
        workload, g = key.split("@")[0], c["gains"]
        if workload == "mixed":
            chosen, oracle = _best(g, "chosen_static"), _best(g, "oracle_static")
            strict = c["per_metric_best"].get(chosen["metric"], {}).get("all") or chosen | {"mean": float("nan")}
            verdicts["mixed_vs_static"][key] = {"chosen": chosen, "oracle": oracle,
                                                "verdict": decide(chosen, GOAL_MIXED),
                                                "verdict_per_metric_best": decide(strict, GOAL_MIXED)}  # fmt: skip
        indep = _best(g, INDEPENDENT)
        verdicts["vs_independent"][key] = {"best": indep, "verdict": decide(indep, 1e-12)}
        if workload != "mixed":
            per = [g.get("oracle_static", {}).get(m, {}).get("all") for m in VERDICT_METRICS]
            per = [x for x in per if x]
            states = [state for state in (decide(x, -GOAL_WITHIN) for x in per) if state != NO_DATA]
            verdict = (
                ("not met" if "not met" in states else ("met" if set(states) == {"met"} else "undecided"))
                if states
                else NO_DATA
            )
            verdicts["within_static"][key] = {"slo": per[0] if per else None, "tpot_p99": per[-1] if per else None,
                                              "verdict": verdict}  # fmt: skip
    return {"held_out_seed": held_out_seed, "comparisons": comparisons, "verdicts": verdicts,
            "bounds": bounds_summary(points)}  # fmt: skip


def _pct(x: dict[str, float]) -> str:
    return f"{100 * x['mean']:+.1f} % [{100 * x['lo']:+.1f}, {100 * x['hi']:+.1f}]"


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """One line per workload and budget: joint's gains (SLO, P99 TPOT) over each partner, then the verdicts."""
    lines = []
    for key, c in summary.get("comparisons", {}).items():
        for partner, g in c["gains"].items():
            parts = [f"{m} {_pct(g[m]['all'])}" for m in METRICS if m in g]
            lines.append(f"{key:24s} joint vs {partner:15s} " + "  ".join(parts))
    for name, per in summary.get("verdicts", {}).items():
        for key, v in per.items():
            lines.append(f"verdict {name:16s} {key:24s} {v['verdict']:9s} {json.dumps(v, default=str)}")
    return lines


def _cell(g: dict[str, Any], partner: str, metric: str) -> str:
    iv = g.get(partner, {}).get(metric, {}).get("all")
    return "–" if not iv else f"{100 * iv['mean']:+.0f} [{100 * iv['lo']:+.0f}, {100 * iv['hi']:+.0f}]"


def markdown_table(summary: dict[str, Any]) -> str:
    """The README's table: joint's gains (%, mean [95 % interval] over seeds) per workload and RAM budget."""
    head = ("| workload @ RAM | vs chosen static: SLO / P99 TPOT | vs oracle static: SLO / P99 TPOT | "
            "vs two LRUs: SLO / P99 TPOT | bytes read vs static / LRUs | stall vs static / LRUs | held-out seed: "
            "P99 TPOT vs static / LRUs |")  # fmt: skip
    lines = [head, "|" + "---|" * 7]
    for key, c in summary["comparisons"].items():
        g = c["gains"]
        held = [g.get(p, {}).get("tpot_p99_ms", {}).get("held_out") for p in ("chosen_static", INDEPENDENT)]
        held_text = " / ".join("–" if h is None else f"{100 * h:+.0f}" for h in held)
        lines.append(
            f"| {key} | {_cell(g, 'chosen_static', 'slo_attainment')} / {_cell(g, 'chosen_static', 'tpot_p99_ms')} "
            f"| {_cell(g, 'oracle_static', 'slo_attainment')} / {_cell(g, 'oracle_static', 'tpot_p99_ms')} "
            f"| {_cell(g, INDEPENDENT, 'slo_attainment')} / {_cell(g, INDEPENDENT, 'tpot_p99_ms')} "
            f"| {_cell(g, 'chosen_static', 'read_bytes')} / {_cell(g, INDEPENDENT, 'read_bytes')} "
            f"| {_cell(g, 'chosen_static', 'stall_s')} / {_cell(g, INDEPENDENT, 'stall_s')} | {held_text} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Recompute ``summary`` and the heatmaps of a sweep.json in place."""
    from fallbackgate.sweep.plot import regime_heatmaps

    path = pathlib.Path((argv or sys.argv[1:])[0])
    result = json.loads(path.read_text())
    held_out = result.get("config", {}).get("held_out_seed", 2)
    result["points"] = with_budget_fields(result["points"])
    result["summary"] = summarise(result["points"], held_out)
    path.write_text(json.dumps(result, indent=1) + "\n")
    regime_heatmaps(result["points"], path.parent)
    print("\n".join(summary_lines(result["summary"])))
    print(markdown_table(result["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
