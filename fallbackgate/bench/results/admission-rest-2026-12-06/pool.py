"""python fallbackgate/bench/results/admission-rest-2026-12-06/pool.py

The mixed workload on seeds 60-99, RAM 0.25 and 0.5: stop 51's parts (seeds 60-69, mixed points of
``../lowbit-fastpath-2026-12-06/A.json`` and ``B.json``) pooled with ``run-mixed.sh``'s (seeds 70-99,
``A-mixed.json`` and ``B-mixed.json``, each its parts merged with ``python -m fallbackgate.sweep.merge``). Same
machine, same engine code (``8c825b7``..``3996551`` changed no engine file), same SLO targets (seeds 50-59's).
Joint as shipped (A) and joint with ``lowbit_colder`` and the opened best-effort budget (B), each against A's
partners: every goal verdict, the gains behind it, and the pooled seeds 70-99 alone as a check."""

import json
import pathlib

from fallbackgate.sweep.summary import INDEPENDENT, summarise
from fallbackgate.sweep.variant import combine

HERE = pathlib.Path(__file__).parent
STOP51 = HERE.parent / "lowbit-fastpath-2026-12-06"


def pct(iv: dict) -> str:
    return f"{100 * iv['mean']:+.1f} % [{100 * iv['lo']:+.1f}, {100 * iv['hi']:+.1f}]"


def mixed_only(result: dict, tag: str) -> dict:
    """``result`` with its mixed points only, run ids prefixed by ``tag`` (the parts ran in two ledgers)."""
    points = [p | {"run_id": f"{tag}:{p['run_id']}"} for p in result["points"] if p["workload"] == "mixed"]
    return {**result, "points": points, "config": {**result["config"], "workloads": ["mixed"]}}


def pooled(old: dict, new: dict) -> dict:
    seeds = sorted(set(old["config"]["seeds"]) | set(new["config"]["seeds"]))
    refs = {"mixed": (new.get("slo_references") or next(iter(new["slo_references_by_source"].values())))["mixed"]}
    return {**new, "points": old["points"] + new["points"], "config": {**new["config"], "seeds": seeds},
            "slo_references": refs, "slo_references_by_source": None}  # fmt: skip


def report(name: str, base: dict, variant: dict) -> None:
    combined = combine(base, variant, ("A", "B"))
    shipped = summarise(base["points"], base["config"]["held_out_seed"])
    print(f"\n## {name}: {len(base['config']['seeds'])} seeds")
    for key, c in combined["summary"]["comparisons"].items():
        s = shipped["comparisons"][key]
        print(f"{key}: chosen static KV {s['chosen_static_kv_share']} (shipped's partners)")
        for label, g in (("shipped", s["gains"]), ("admission", c["gains"])):
            static, lru = g["chosen_static"], g[INDEPENDENT]
            print(f"  {label:9s} vs chosen static: SLO {pct(static['slo_attainment']['all'])}, P99 TPOT "
                  f"{pct(static['tpot_p99_ms']['all'])}; vs two LRUs: SLO {pct(lru['slo_attainment']['all'])}, "
                  f"P99 TPOT {pct(lru['tpot_p99_ms']['all'])}")
        q = combined["joint_quality"][key]
        v, vs_base = q["variant"], q["variant_gain_over_base"]
        print(f"  admission vs shipped joint: SLO {pct(vs_base['slo_attainment'])}, P99 TPOT "
              f"{pct(vs_base['tpot_p99_ms'])}; mean KL {v['mean_kl']:.1e} (worst {v['worst_mean_kl']:.1e}), gates "
              f"{v['gates_passed']:.0f}/{v['runs']}, low-bit uses per run {v['lowbit_experts'] / v['runs']:.0f}")
    for label, summary in (("shipped", shipped), ("admission", combined["summary"])):
        for goal, cells in summary["verdicts"].items():
            for key, verdict in cells.items():
                metric = verdict.get("chosen", verdict.get("best", {})).get("metric", "")
                print(f"  {label:9s} {goal:16s} {key:10s} {verdict['verdict']:9s} {metric} "
                      f"strict {verdict.get('verdict_per_metric_best', '-')}")
        bounds = summary["bounds"]["joint"].get("expert_read_over_belady_same_room")
        if bounds:
            print(f"  {label:9s} joint expert bytes over Belady's MIN at the same room {bounds['mean']:.3f}x "
                  f"[{bounds['lo']:.3f}, {bounds['hi']:.3f}]")


def main() -> None:
    load = lambda path: json.loads(path.read_text())  # noqa: E731
    old_a, old_b = mixed_only(load(STOP51 / "A.json"), "s51"), mixed_only(load(STOP51 / "B.json"), "s51")
    new_a, new_b = load(HERE / "A-mixed.json"), load(HERE / "B-mixed.json")
    report("seeds 70-99 (run-mixed.sh alone)", new_a, new_b)
    report("seeds 60-99 (stop 51's 60-69 pooled)", pooled(old_a, new_a), pooled(old_b, new_b))


if __name__ == "__main__":
    main()
