"""Parity reports: JSON (everything) and markdown (a table per run, one line per failed check)."""

from __future__ import annotations

import json
import pathlib
from typing import Any


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) >= 1e4 or (value != 0 and abs(value) < 1e-3) else f"{value:.4f}"
    return str(value)


def failure_lines(report: dict[str, Any]) -> list[str]:
    """One line per failed check, naming the task, the score gap and its interval."""
    lines = []
    for t in report["tasks"]:
        for c in t["checks"]:
            if not c["passed"]:
                level = round(100 * t["confidence"])
                lines.append(
                    f"FAIL {t['task']}: {c['check']} {_num(c['value'])} (limit {c['op']} {_num(c['limit'])}); "
                    f"{t['metric']} exact {_num(t['exact_score'])} vs policy {_num(t['policy_score'])}, "
                    f"gap {_num(t['difference'])}, {level}% CI [{_num(t['ci'][0])}, {_num(t['ci'][1])}]"
                )
    return lines


def to_markdown(report: dict[str, Any]) -> str:
    """The human-readable report."""
    verdict = "PASS" if report["passed"] else "FAIL"
    out = [
        f"# Parity: {verdict}",
        "",
        f"policy `{report['policy']}` (controller {report['controller']}, mode {report['mode']}) against the exact "
        f"baseline; model `{report['model']}`; limit {report['limit']}; ledger `{report['ledger']}`",
        "",
        "| task | metric | n | exact | policy | difference | CI | McNemar p | agreement | PPL ratio | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in report["tasks"]:
        mc = t["mcnemar"]
        ci = f"[{_num(t['ci'][0])}, {_num(t['ci'][1])}] ({round(100 * t['confidence'])}%)"
        out.append(
            f"| {t['task']} | {t['metric']} | {t['num_items']} | {_num(t['exact_score'])} | {_num(t['policy_score'])} "
            f"| {_num(t['difference'])} | {ci} | {_num(mc['p_value']) if mc else '–'} | {t['agreement']:.1%} "
            f"| {_num(t['ppl_ratio'], 6)} | {'pass' if t['passed'] else 'FAIL'} |"
        )
    out += ["", "## Ledger drift (policy run, audited against the exact baseline)", ""]
    out += [
        "| task | run | audited requests | mean KL | max p99 KL | max KL | top-1 agreement | tags |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in report["tasks"]:
        d = t["drift"]
        if d is None:
            out.append(f"| {t['task']} | – | – | – | – | – | – | – |")
            continue
        tags = ", ".join(f"{k} {v}" for k, v in sorted(d["tags"].items()))
        out.append(
            f"| {t['task']} | {d['run_id']} | {d['audited_requests']} | {_num(d['mean_kl'])} | {_num(d['max_p99_kl'])} "
            f"| {_num(d['max_kl'])} | {_num(d['top1_agreement'])} | {tags} |"
        )
    out += ["", "## Checks", ""]
    for t in report["tasks"]:
        for c in t["checks"]:
            mark = "pass" if c["passed"] else "FAIL"
            out.append(f"- {t['task']}: {c['check']} {_num(c['value'])} {c['op']} {_num(c['limit'])}: {mark}")
    fails = failure_lines(report)
    if fails:
        out += ["", "## Failures", ""] + [f"- {line}" for line in fails]
    return "\n".join(out) + "\n"


def write_reports(report: dict[str, Any], directory: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``parity.md`` and ``parity.json`` into `directory`; returns their paths."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    md, js = directory / "parity.md", directory / "parity.json"
    md.write_text(to_markdown(report))
    js.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return md, js
