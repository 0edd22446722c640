"""Parity runner: the exact engine and a policy's engine on the same items, compared item by item.

Inputs are checked before any model work (:func:`prepare`): the policy file (schema + ``parity`` section),
task names, local data files, the model directory. Then, per task, both engines run through lm-eval's
``simple_evaluate`` with logged samples; the policy's run is recorded to the ledger (one run per task), and
the comparison (:mod:`fallbackgate.evals.parity_stats`) is judged against the policy's declared tolerances.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import TYPE_CHECKING, Any

from fallbackgate.evals.task_dir import TaskError, check_tasks, render_include_dir
from fallbackgate.evals.tolerances import ParitySpec, TaskTolerance, load_parity_policy
from fallbackgate.policy import Policy
from fallbackgate.tinymoe import CHECKPOINT_DIR

if TYPE_CHECKING:  # lm-eval loads only when a parity run starts
    from fallbackgate.evals.lm_adapter import FallbackgateLM


class ParityInputError(ValueError):
    """Bad input found before any model work: policy, task, data file or model directory."""


@dataclasses.dataclass
class ParityConfig:
    """What ``fallbackgate parity`` was asked to do."""

    policy_path: str
    tasks: list[str]
    limit: int | None = None
    model_dir: str | None = None
    report_dir: str | None = None
    include_paths: list[str] = dataclasses.field(default_factory=list)  # extra task YAML directories
    data_dir: str | None = None  # data for the bundled task templates (default: evals/data)
    ledger: str | None = None  # default: the policy's ledger URL, else $FALLBACKGATE_LEDGER
    force: list[str] = dataclasses.field(default_factory=list)
    batch_size: int = 64
    seed: int = 0
    chunk_tokens: int = 4096  # engine tokens per forward on both sides (small: windows split into chunks)


@dataclasses.dataclass
class Prepared:
    """Validated inputs."""

    config: ParityConfig
    policy: Policy
    spec: ParitySpec
    include_dirs: list[str]
    model_dir: str


def prepare(config: ParityConfig) -> Prepared:
    """Validate everything that can be wrong without loading a model; raises :class:`ParityInputError`."""
    from fallbackgate.policy import PolicyError

    try:
        policy, spec = load_parity_policy(config.policy_path)
    except PolicyError as exc:
        raise ParityInputError(str(exc)) from None
    if config.limit is not None and config.limit < 1:
        raise ParityInputError(f"--limit must be >= 1, got {config.limit}")
    include = [str(render_include_dir(config.data_dir))] + [str(p) for p in config.include_paths]
    try:
        check_tasks(config.tasks, include)
    except TaskError as exc:
        raise ParityInputError(str(exc)) from None
    model_dir = config.model_dir or policy.model or str(CHECKPOINT_DIR)
    if not (pathlib.Path(model_dir) / "config.json").is_file():
        raise ParityInputError(f"model directory {model_dir} has no config.json")
    return Prepared(config, policy, spec, include, model_dir)


# Relative perplexity difference two exact computations of the same tokens may show in a dtype: rows batched
# differently run through GEMMs of other shapes, whose summation order differs (observed: 1e-7 in fp32).
PPL_NUMERIC_FLOOR = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 4e-3}


def judge(result: dict[str, Any], tol: TaskTolerance, dtype: str = "float32") -> list[dict[str, Any]]:
    """Checks of one task's comparison against its tolerances (perplexity metrics use the ratio, not the drop).

    The perplexity limit is the tolerance times (1 + the dtype's numeric floor), so "exact" (ratio 1.0) means
    equal up to summation order, not bit for bit across different batch shapes."""
    checks = []
    if result["ppl_ratio"] is None:
        checks.append(_check("score drop", result["drop"], tol.max_score_drop, "<="))
    else:
        floor = PPL_NUMERIC_FLOOR.get(dtype, PPL_NUMERIC_FLOOR["bfloat16"])
        checks.append(_check("perplexity ratio", result["ppl_ratio"], tol.max_ppl_ratio * (1 + floor), "<="))
        checks[-1]["numeric_floor"] = floor
    checks.append(_check("agreement", result["agreement"], tol.min_agreement, ">="))
    return checks


def _check(name: str, value: float, limit: float, op: str) -> dict[str, Any]:
    passed = value <= limit + 1e-12 if op == "<=" else value >= limit - 1e-12
    return {"check": name, "value": value, "op": op, "limit": limit, "passed": bool(passed)}


def ledger_drift(url: str | None, run_id: int | None) -> dict[str, Any] | None:
    """The audited drift of one ledger run: KL and top-1 agreement over its audited requests, and its tags."""
    if run_id is None:
        return None
    from fallbackgate.ledger.db import open_ledger
    from fallbackgate.ledger.queries import get_run, request_summaries, run_tag_counts

    ledger = open_ledger(url, read_only=True)
    try:
        audited = [r for r in request_summaries(ledger, run_id) if r.get("mean_kl") is not None]
        tags: dict[str, int] = {}
        for row in run_tag_counts(ledger, run_id):
            tags[row["tag"]] = tags.get(row["tag"], 0) + int(row["objects"] or 0)
        run = get_run(ledger, run_id) or {}
    finally:
        ledger.close()
    positions = sum(int(r["num_positions"] or 0) for r in audited)
    return {
        "run_id": run_id,
        "audited_requests": len(audited),
        "audited_positions": positions,
        "mean_kl": sum(r["mean_kl"] * r["num_positions"] for r in audited) / positions if positions else None,
        "max_p99_kl": max((r["p99_kl"] for r in audited), default=None),
        "max_kl": max((r["max_kl"] for r in audited), default=None),
        "top1_agreement": sum(r["top1_agreement"] * r["num_positions"] for r in audited) / positions
        if positions
        else None,
        "numeric_floor_kl": run.get("numeric_floor_kl"),
        "tags": tags,
    }


def _evaluate(lm: Any, task: str, prepared: Prepared) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=prepared.include_dirs, include_defaults=False)
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=[task],
        task_manager=manager,
        limit=prepared.config.limit,
        log_samples=True,
        random_seed=prepared.config.seed,
        numpy_random_seed=prepared.config.seed,
        torch_random_seed=prepared.config.seed,
        bootstrap_iters=0,
    )


def _parity_task(
    exact: FallbackgateLM, policy_lm: FallbackgateLM, task: str, prepared: Prepared, dtype: str
) -> dict[str, Any]:
    """One task on both engines (the policy's run recorded and gated), compared item by item and judged."""
    from fallbackgate.evals.parity_stats import compare, task_items

    cfg = prepared.config
    base = _evaluate(exact, task, prepared)
    run_id = policy_lm.start_run(note=f"parity {task} limit={cfg.limit}")
    approx = _evaluate(policy_lm, task, prepared)
    verdict = policy_lm.finish()
    result = compare(
        task_items(base, task),
        task_items(approx, task),
        samples=prepared.spec.bootstrap_samples,
        confidence=prepared.spec.confidence,
        seed=cfg.seed,
    )
    tol = prepared.spec.for_task(task)
    checks = judge(result, tol, dtype)
    result.update(
        task=task,
        tolerances=tol.model_dump(),
        checks=checks,
        passed=all(c["passed"] for c in checks),
        drift=ledger_drift(policy_lm.ledger_url, run_id),
        gate=None if verdict is None else {"passed": verdict.passed, "reasons": verdict.reasons},
    )
    return result


def run_parity(prepared: Prepared) -> dict[str, Any]:
    """Run both engines on every task and build the report (see :mod:`fallbackgate.evals.parity_report`)."""
    from fallbackgate.evals.engine_setup import build_setup
    from fallbackgate.evals.lm_adapter import FallbackgateLM

    cfg = prepared.config
    exact = FallbackgateLM(
        setup=build_setup(
            prepared.model_dir,
            prepared.policy,
            exact_baseline=True,
            policy_name=cfg.policy_path,
            chunk_tokens=cfg.chunk_tokens,
        ),
        ledger="none",
        batch_size=cfg.batch_size,
    )
    setup = build_setup(
        prepared.model_dir, prepared.policy, force=cfg.force, policy_name=cfg.policy_path, chunk_tokens=cfg.chunk_tokens
    )
    policy_lm = FallbackgateLM(setup=setup, ledger=cfg.ledger, batch_size=cfg.batch_size)
    url = policy_lm.ledger_url
    tasks = [_parity_task(exact, policy_lm, task, prepared, setup.engine.dtype_name) for task in cfg.tasks]
    return {
        "policy": cfg.policy_path,
        "model": prepared.model_dir,
        "controller": setup.controller_name,
        "mode": prepared.policy.audit.mode,
        "limit": cfg.limit,
        "ledger": None if url is None else str(url),
        "passed": all(t["passed"] for t in tasks),
        "tasks": tasks,
    }
