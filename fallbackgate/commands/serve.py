"""``fallbackgate serve [--policy FILE] [--host 127.0.0.1] [--port 8000] [--ledger URL]``: an
OpenAI-compatible server (FastAPI + uvicorn) over one engine loop, with per-request quality classes,
background audits and Prometheus metrics at ``/metrics``.

One ledger run per server start. ``audit.sample_rate`` of the requests (``--audit-rate`` without a policy)
are left to an audit worker process started beside the server with the lowest CPU priority and one thread
(``fallbackgate audit --run ID --follow``), never audited on the serving path. SIGTERM or SIGINT: stop
accepting, let in-flight requests finish for ``--grace-s``, end the rest as interrupted (run marked
incomplete), flush the ledger, exit 0.

Exit status: 0 after a clean shutdown, 2 for bad arguments, policy, model or ledger.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
from typing import Any

from fallbackgate.batch.prompts import PromptsFileError
from fallbackgate.batch.recording import start_run
from fallbackgate.batch.session import RunSettings, build_engine, memory_summary
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.errors import EngineError
from fallbackgate.ledger.db import DEFAULT_LEDGER, ENV_VAR, LedgerError, open_ledger
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.policy.apply import (
    build_policy_engine,
    class_budgets,
    class_slos,
    merge_args,
    policy_record,
    run_settings,
)
from fallbackgate.policy.loader import load_policy
from fallbackgate.tinymoe import CHECKPOINT_DIR


def add_parser(subparsers: Any) -> None:
    """Register ``serve``."""
    p: argparse.ArgumentParser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with metrics")
    p.add_argument("--policy", default=None, help="policy YAML: classes, budgets, SLOs, memory, ledger")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the policy's, else bundled)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--ledger", default=None, help=f"ledger URL (default: the policy's, ${ENV_VAR}, {DEFAULT_LEDGER})")
    p.add_argument("--no-ledger", action="store_true", help="record nothing, audit nothing")
    p.add_argument("--audit-rate", type=float, default=None, help="fraction audited without a policy (default 0.1)")
    p.add_argument("--audit-workers", type=int, default=1, help="background audit processes (0: leave to others)")
    p.add_argument("--grace-s", type=float, default=30.0, help="seconds in-flight requests get at shutdown")
    p.add_argument("--device-budget-mb", type=float, default=None)
    p.add_argument("--host-budget-mb", type=float, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded together at most")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be 1..65535, got {args.port}")
    if args.audit_rate is not None and not 0.0 <= args.audit_rate <= 1.0:
        raise ValueError(f"--audit-rate must be in [0, 1], got {args.audit_rate}")
    if not 0 <= args.audit_workers <= 16:
        raise ValueError(f"--audit-workers must be 0..16, got {args.audit_workers}")
    if not 0.0 <= args.grace_s <= 3600.0:
        raise ValueError(f"--grace-s must be 0..3600, got {args.grace_s}")


def _setup(args: argparse.Namespace) -> tuple[Any, LedgerWriter | None, dict[str, Any], float, str, Any]:
    """Engine, writer, classes, audit rate, default class and policy (None without one)."""
    args.max_new_tokens, args.temperature = 16, 0.0  # per request in the body; these only fill RunSettings
    if args.policy is None:
        settings = RunSettings(
            args.model or str(CHECKPOINT_DIR),
            device_budget_mb=args.device_budget_mb,
            host_budget_mb=args.host_budget_mb,
            max_num_seqs=args.max_num_seqs or 8,
            dtype=args.dtype,
            seed=args.seed,
        )
        writer = None if args.no_ledger else LedgerWriter(open_ledger(args.ledger))
        engine = build_engine(settings, ExactLRUController())
        rate = 0.1 if args.audit_rate is None else args.audit_rate
        return engine, writer, {"default": {}}, rate, "default", None
    policy = merge_args(load_policy(args.policy), args)
    url = args.ledger or policy.ledger.url
    writer = None if args.no_ledger else LedgerWriter(open_ledger(url))
    engine, _ = build_policy_engine(policy, run_settings(policy, args), writer.ledger if writer else None)
    budgets, slos = class_budgets(policy), class_slos(policy)
    classes = {name: {"budget": budgets[name], "slo": slos[name]} for name in policy.classes}
    return engine, writer, classes, policy.audit.sample_rate, policy.default_class, policy


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate serve``."""
    import uvicorn

    from fallbackgate.api_server.app import ServerInfo, build_app
    from fallbackgate.api_server.metrics import ServerMetrics
    from fallbackgate.api_server.service import EngineService

    try:
        _check(args)
        engine, writer, classes, rate, default_class, policy = _setup(args)
    except (PromptsFileError, EngineError, LedgerError, ValueError) as exc:
        print(f"fallbackgate serve: error: {exc}", file=sys.stderr)
        return 2
    kind = policy.controller.kind if policy is not None else "exact_lru"
    run_id = None
    if writer is not None:
        record = policy_record(policy) if policy is not None else None
        name = pathlib.Path(args.policy).stem if policy is not None else None
        run_id = start_run(writer, engine, controller=kind, note="serve", policy=record, policy_name=name)
    service = EngineService(
        engine, writer, ServerMetrics(), classes=classes, audit_rate=rate if writer else 0.0, seed=args.seed
    )
    workers = _start_audit_workers(args, writer, run_id) if writer is not None and rate > 0 else []

    def shutdown() -> None:
        status = service.drain(args.grace_s)
        if writer is not None:
            if service.num_audits_queued:
                writer.queue_audits([], with_run_task=True)
            writer.record_memory(memory_summary(engine))
            writer.finish_run(status=status)
            writer.close()
        engine.close()
        for proc in workers:
            try:
                proc.wait(timeout=args.grace_s)
            except subprocess.TimeoutExpired:
                proc.terminate()  # its claims expire; any `fallbackgate audit` finishes them
        print(f"fallbackgate serve: run {run_id} {status}; {service.num_interrupted} request(s) interrupted")

    info = ServerInfo(pathlib.Path(engine.config.model_dir).name, run_id, default_class, shutdown)
    app = build_app(service, info)
    print(
        f"fallbackgate serve: http://{args.host}:{args.port}/v1 (model {info.model_name!r}, run {run_id})", flush=True
    )
    uvicorn.run(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=int(args.grace_s) or None
    )
    return 0


def _start_audit_workers(args: argparse.Namespace, writer: LedgerWriter, run_id: int | None) -> list[subprocess.Popen]:
    env = {**os.environ, ENV_VAR: writer.ledger.url.render_as_string(hide_password=False)}  # not on a command line
    cmd = [sys.executable, "-m", "fallbackgate", "audit", "--run", str(run_id), "--follow", "--threads", "1"]
    cmd += ["--nice", "19"]
    return [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL) for _ in range(args.audit_workers)]
