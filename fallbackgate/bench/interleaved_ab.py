"""python -m fallbackgate.bench.interleaved_ab --seeds 60,61,62 --workloads mixed,multi-turn --ram-frac 0.25
    --variant shipped=exact --variant colder=lowbit_colder:best-effort-open.yaml [--slo-from SWEEP.json]
    --out OUT.json

Joint variants run after run: for each seed and workload every variant runs once, one after the other, the order
rotated by one per seed (each variant runs first equally often when the number of seeds is a multiple of the
number of variants; otherwise a note says so), so machine drift between windows minutes apart cannot enter the
comparison (parts of a sweep
run minutes apart moved a time metric by up to 20 % with no byte moved: README, stop 50). A variant is an
expert admission (``controller.expert_admission``) and, after a colon, a class-budgets YAML as
``fallbackgate sweep --class-budgets`` reads it. SLO targets come from ``--slo-from`` (an earlier sweep with the
same grid but for seeds, workloads, controllers and which of its RAM budgets) or from one all-in-RAM reference run
per workload made first; every variant is measured against the same targets. Prints per cell and metric each
variant's mean and its paired change against the first variant (% of the first's mean, Student-t 95 % over the
seeds; no interval from one seed); writes every run's metrics and that comparison as JSON, rewritten after each
run. A run that fails is recorded with its error (``failed_runs``) and the A/B goes on without it: its seed is
left out of that cell's comparison, and the exit status is 1. A metric the runs do not record stops the A/B
after its first run (exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import tempfile
from typing import Any

import tqdm

from fallbackgate.bench.joint_ab import DERIVED
from fallbackgate.engine.errors import EngineError
from fallbackgate.ledger.db import open_ledger
from fallbackgate.policy.schema import EXPERT_ADMISSIONS
from fallbackgate.sweep.inputs import earlier_references, read_class_budgets
from fallbackgate.sweep.intervals import interval
from fallbackgate.sweep.regime import RegimeConfig, run_regime, sweep_policy
from fallbackgate.sweep.summary import JOINT
from fallbackgate.tinymoe import CHECKPOINT_DIR

DEFAULT_METRICS = ("ttft_p50_ms", "tpot_p99_ms", "slo_attainment", "over_belady_same_room", "lowbit_uses", "mean_kl")


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    """One joint configuration of the A/B."""

    name: str  # what the report calls it
    admission: str  # controller.expert_admission
    class_budgets: dict[str, dict[str, Any]] | None  # fields replaced in the classes' budgets (None: as shipped)


def parse_variant(text: str) -> Variant:
    """``NAME=ADMISSION[:BUDGETS.yaml]`` (ValueError naming what is wrong)."""
    name, sep, spec = text.partition("=")
    if not sep or not name or not spec:
        raise ValueError(f"--variant {text!r}: expected NAME=ADMISSION[:BUDGETS.yaml]")
    admission, _, budgets = spec.partition(":")
    if admission not in EXPERT_ADMISSIONS:
        raise ValueError(f"--variant {text!r}: admission {admission!r} is not one of {', '.join(EXPERT_ADMISSIONS)}")
    return Variant(name, admission, read_class_budgets(pathlib.Path(budgets)) if budgets else None)


def run_order(names: list[str], seed_index: int) -> list[str]:
    """The variants' order for the `seed_index`-th seed: rotated by one per seed, so each runs first as often."""
    shift = seed_index % len(names)
    return names[shift:] + names[:shift]


def compare(rows: list[dict[str, Any]], names: list[str], metrics: tuple[str, ...]) -> dict[str, Any]:
    """Per cell (``workload@ram``) and metric: each variant's mean and its paired change against the first
    variant over the seeds every variant ran (% of the first's mean; None where that mean is 0)."""
    cells: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
    for row in rows:
        cells.setdefault(f"{row['workload']}@{row['ram_frac']}", {}).setdefault(row["seed"], {})[row["variant"]] = row
    out: dict[str, Any] = {}
    for cell, by_seed in cells.items():
        seeds = sorted(s for s, runs in by_seed.items() if all(n in runs for n in names))
        out[cell] = {"seeds": seeds, "metrics": {}}
        for metric in metrics:
            base = [by_seed[s][names[0]]["metrics"].get(metric, math.nan) for s in seeds]
            mean_base = sum(base) / len(base) if base else 0.0
            entry = {}
            for name in names:
                values = [by_seed[s][name]["metrics"].get(metric, math.nan) for s in seeds]
                diffs = [(v - b) / mean_base for v, b in zip(values, base, strict=True)] if mean_base else []
                change = interval(diffs) if name != names[0] and diffs else None
                if change is not None and change["n"] < 2:  # one pair has no spread to make an interval from
                    change |= {"lo": None, "hi": None}
                entry[name] = {"mean": sum(values) / len(values) if values else None, "change": change}
            out[cell]["metrics"][metric] = entry
    return out


def report_lines(comparison: dict[str, Any], names: list[str]) -> list[str]:
    """The comparison as text: a line per cell and metric."""
    lines = []
    for cell, body in comparison.items():
        lines.append(f"{cell} n={len(body['seeds'])}")
        for metric, entry in body["metrics"].items():
            parts = []
            for name in names:
                mean, change = entry[name]["mean"], entry[name]["change"]
                text = f"{name} {mean:.3g}" if mean is not None else f"{name} -"
                if change is not None and change["lo"] is None:
                    text += f" ({100 * change['mean']:+.1f} %, n={change['n']}: no interval)"
                elif change is not None:
                    text += (f" ({100 * change['mean']:+.1f} % [{100 * change['lo']:+.1f}, {100 * change['hi']:+.1f}]"
                             f", n={change['n']})")  # fmt: skip
                parts.append(text)
            lines.append(f"  {metric:22s} " + "  ".join(parts))
    return lines


def run_one(base: RegimeConfig, variant: Variant, workload: str, seed: int, ledger: Any) -> dict[str, Any]:
    """One joint run of `variant`; its metrics (recorded and derived)."""
    cfg = dataclasses.replace(base, workloads=(workload,), seeds=(seed,), expert_admission=variant.admission,
                              class_budgets=variant.class_budgets)  # fmt: skip
    (point,) = run_regime(cfg, ledger, log=lambda line: None)["points"]
    metrics = {k: v for k, v in point["metrics"].items() if isinstance(v, int | float)}
    metrics.update({name: fn(point["metrics"]) for name, fn in DERIVED.items()})
    return {"seed": seed, "workload": workload, "ram_frac": base.ram_fracs[0], "variant": variant.name,
            "metrics": metrics}  # fmt: skip


def slo_targets(base: RegimeConfig, path: pathlib.Path | None, ledger: Any) -> dict[str, dict[str, Any]]:
    """Each workload's SLO reference: the earlier sweep's at `path` (its grid must match but for seeds,
    workloads, controllers and which of its RAM budgets this runs), or one reference run each."""
    if path is None:
        return {kind: sweep_policy(dataclasses.replace(base, workloads=(kind,)), kind, ledger)[1]
                for kind in base.workloads}  # fmt: skip
    try:
        fracs = tuple(json.loads(path.read_text())["config"]["ram_fracs"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--slo-from {path}: {exc}") from None
    if base.ram_fracs[0] not in fracs:
        raise ValueError(f"--slo-from {path}: its ram_fracs {list(fracs)} do not include {base.ram_fracs[0]}")
    return earlier_references(dataclasses.replace(base, ram_fracs=fracs), path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fallbackgate.bench.interleaved_ab", description=__doc__.split("\n\n")[1]
    )
    p.add_argument("--seeds", required=True, help="workload seeds, comma-separated")
    p.add_argument("--workloads", required=True, help="workload kinds, comma-separated")
    p.add_argument("--ram-frac", type=float, required=True, help="RAM budget as a fraction of experts + KV demand")
    p.add_argument("--variant", action="append", required=True, help="NAME=ADMISSION[:BUDGETS.yaml], two or more")
    p.add_argument("--slo-from", type=pathlib.Path, default=None, metavar="SWEEP_JSON")
    p.add_argument("--metrics", default=",".join(DEFAULT_METRICS), help="metrics compared, comma-separated")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--out", type=pathlib.Path, required=True, help="JSON with every run and the comparison")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        variants = [parse_variant(text) for text in args.variant]
        names = [v.name for v in variants]
        if len(names) < 2 or len(set(names)) != len(names):
            raise ValueError(f"--variant: two or more, each named once (got {names})")
        seeds = tuple(int(s) for s in args.seeds.split(","))
        base = RegimeConfig(model_dir=args.model or str(CHECKPOINT_DIR), workloads=tuple(args.workloads.split(",")),
                            seeds=seeds, ram_fracs=(args.ram_frac,), controllers=(JOINT,))  # fmt: skip
        metrics = tuple(args.metrics.split(","))
    except ValueError as exc:
        print(f"interleaved_ab: error: {exc}", file=sys.stderr)
        return 2
    if len(seeds) % len(names):
        print(f"interleaved_ab: note: {len(seeds)} seeds for {len(names)} variants: the variants do not each run "
              "first equally often", file=sys.stderr)  # fmt: skip
    return _run_all(args, base, variants, metrics)


def _run_all(args: argparse.Namespace, base: RegimeConfig, variants: list[Variant], metrics: tuple[str, ...]) -> int:
    """Every run of the plan, the JSON rewritten after each; the exit status."""
    names, by_name = [v.name for v in variants], {v.name: v for v in variants}
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []  # runs that raised: seed, workload, variant, error
    error = None  # what stopped the A/B (bad input found once runs began)
    with tempfile.TemporaryDirectory(prefix="fg-interleaved-") as scratch:
        ledger = open_ledger(f"sqlite:///{scratch}/ledger.sqlite")
        try:
            base = dataclasses.replace(base, lowbit_dir=f"{scratch}/lowbit",
                                       slo_from=slo_targets(base, args.slo_from, ledger))  # fmt: skip
            plan = [(s, w, n) for i, s in enumerate(base.seeds) for w in base.workloads for n in run_order(names, i)]
            for seed, workload, name in tqdm.tqdm(plan, desc="runs", unit="run"):
                try:
                    row = run_one(base, by_name[name], workload, seed, ledger)
                except Exception as exc:  # noqa: BLE001 -- a run's fault stays with that run
                    failed.append({"seed": seed, "workload": workload, "variant": name, "error": repr(exc)})
                    print(f"interleaved_ab: run {name} {workload} seed {seed} failed: {exc!r}", file=sys.stderr)
                else:
                    rows.append(row)
                    unknown = sorted(set(metrics) - set(row["metrics"])) if len(rows) == 1 else []
                    if unknown:  # checked once, on the first run that did not fail
                        raise ValueError(f"--metrics: the runs record no {', '.join(unknown)} (they record: "
                                         f"{', '.join(sorted(row['metrics']))})")  # fmt: skip
                _write(args, variants, rows, failed, names, metrics, error, is_complete=False)
        except (EngineError, ValueError) as exc:  # bad input found once runs began: the runs so far are kept
            error = str(exc)
        finally:
            ledger.close()
    if error is not None:
        print(f"interleaved_ab: error: {error}", file=sys.stderr)
        if not rows and not failed:
            return 2  # refused before any run: nothing to write
    _write(args, variants, rows, failed, names, metrics, error, is_complete=error is None)
    print("\n".join(report_lines(compare(rows, names, metrics), names)))
    if error is not None and error.startswith("--metrics"):
        return 2
    return 0 if error is None and not failed else 1


def _write(args: argparse.Namespace, variants: list[Variant], rows: list[dict[str, Any]],
           failed: list[dict[str, Any]], names: list[str], metrics: tuple[str, ...], error: str | None,
           is_complete: bool) -> None:  # fmt: skip
    """The JSON as it stands: every run so far, the failed ones, the comparison and whether the plan ran."""
    body = {"command": " ".join(sys.argv), "variants": [dataclasses.asdict(v) for v in variants], "runs": rows,
            "failed_runs": failed, "comparison": compare(rows, names, metrics), "error": error,
            "is_complete": is_complete}  # fmt: skip
    args.out.write_text(json.dumps(body, indent=1))


if __name__ == "__main__":
    sys.exit(main())
