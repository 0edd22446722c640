"""``fallbackgate lm-eval [LM-EVAL ARGS ...]``: lm-eval's own command line with the ``fallbackgate`` model.

Everything after ``lm-eval`` goes to lm-eval's CLI (``lm_eval --help`` lists it), with three defaults
filled in when not given: ``--model fallbackgate``, ``--include_path`` pointing at the shipped tasks
(``fg_cloze``, ``fg_rolling_ppl``, ``fg_names``, rendered with absolute data paths) and ``--device`` set to
the real device (``cpu`` without a GPU). After lm-eval finishes, each fallbackgate model's ledger run is
judged: the run id and the gate's verdict are printed, and written as ``fallbackgate.json`` beside
lm-eval's results when ``--output_path`` is a directory. ``fallbackgate lm-eval --print-include-path``
prints a ready include path for other uses of the tasks.

Exit status: lm-eval's own, or 1 when a gate verdict fails.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

from fallbackgate.profiling.store import cache_dir

TASKS_SUBDIR = "lm_eval_tasks"


def add_parser(subparsers: Any) -> None:
    """Register ``lm-eval``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "lm-eval", help="lm-eval's CLI with the fallbackgate model and the shipped tasks", add_help=False
    )
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="arguments for lm-eval")
    p.set_defaults(func=run)


def include_path() -> pathlib.Path:
    """The shipped task YAMLs rendered with absolute data paths, in the user cache (refreshed each call)."""
    from fallbackgate.evals.task_dir import render_include_dir

    return render_include_dir(dest=cache_dir() / TASKS_SUBDIR)


def _with_defaults(args: list[str]) -> list[str]:
    import torch

    names = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    out = list(args)
    if "--model" not in names:
        out += ["--model", "fallbackgate"]
    if "--include_path" not in names:
        out += ["--include_path", str(include_path())]
    if "--device" not in names:
        out += ["--device", "cuda" if torch.cuda.is_available() else "cpu"]
    return out


def run(args: argparse.Namespace) -> int:
    """Run lm-eval's CLI in this process, then judge and report every fallbackgate model's run."""
    rest = list(args.lm_eval_args)
    if rest[:1] == ["--print-include-path"]:
        print(include_path())
        return 0
    from lm_eval.__main__ import cli_evaluate

    import fallbackgate  # noqa: F401 - registers the model with lm-eval
    from fallbackgate.evals.lm_adapter import FallbackgateLM

    first = len(FallbackgateLM.instances)  # models made before (tests, notebooks) are not this run's
    argv, sys.argv = sys.argv, ["lm_eval", *_with_defaults(rest)]
    try:
        status = cli_evaluate()
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        sys.argv = argv
    reports = []
    for lm in FallbackgateLM.instances[first:]:
        run_id, verdict = lm.run_id, lm.finish()
        reports.append(
            {
                "run_id": run_id,
                "passed": None if verdict is None else verdict.passed,
                "reasons": [] if verdict is None else verdict.reasons,
            }
        )
        state = "no ledger" if run_id is None else ("PASS" if verdict and verdict.passed else "FAIL")
        detail = "; ".join(reports[-1]["reasons"])
        print(f"fallbackgate: ledger run {run_id}: {state}" + (f" ({detail})" if detail else ""))
    _write_report(rest, reports)
    if any(r["passed"] is False for r in reports):
        return 1
    return int(status or 0)


def _write_report(args: list[str], reports: list[dict[str, Any]]) -> None:
    """fallbackgate.json beside lm-eval's results (when --output_path names a directory)."""
    for i, arg in enumerate(args):
        value = None
        if arg == "--output_path" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--output_path="):
            value = arg.split("=", 1)[1]
        if value and pathlib.Path(value).is_dir():
            (pathlib.Path(value) / "fallbackgate.json").write_text(json.dumps({"runs": reports}, indent=2) + "\n")
