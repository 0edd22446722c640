"""``fallbackgate serve [--policy FILE] [--host 127.0.0.1] [--port 8000] [--ledger URL]``: an
OpenAI-compatible server (FastAPI + uvicorn) over one engine loop, with per-request quality classes,
background audits and Prometheus metrics at ``/metrics``.

One ledger run per server start. ``audit.sample_rate`` of the requests (``--audit-rate`` without a policy)
are left to an audit worker process started beside the server with the lowest CPU priority and one thread
(``fallbackgate audit --run ID --follow``), never audited on the serving path. SIGTERM or SIGINT: stop
accepting, let in-flight requests finish for ``--grace-s``, end the rest as interrupted (each recorded as a
cancelled request with what it had produced; the run marked incomplete), flush the ledger, exit 0. Bodies
over ``--max-body-mb`` get 413 before they are read; beyond ``--max-num-seqs`` running and ``--max-queued``
waiting requests, new ones get 429 with ``Retry-After``. ``--request-timeout-s`` ends a request running longer
(504); a client that disconnects ends its request; ``--api-key`` (or ``$FALLBACKGATE_API_KEY``) closes the
/v1/ routes to requests without ``Authorization: Bearer KEY``. A PostgreSQL ledger may go away (restart,
network) for up to ``--ledger-retry-s``: serving goes on, records wait in memory and are written once when it
returns; while they reach ``--ledger-buffer-mb`` new requests get 503 with ``Retry-After`` (admitted ones run
on). Audit workers reconnect.

Exit status: 0 after a clean shutdown, 2 for bad arguments, policy, model or ledger.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fallbackgate.assembly import Assembly, Overrides, assemble, no_policy
from fallbackgate.batch.prompts import PromptsFileError
from fallbackgate.batch.session import memory_summary
from fallbackgate.commands.checks import add_kv_flags, add_trace_flag, check_trace_flag
from fallbackgate.engine import heap
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import EngineError
from fallbackgate.ledger.backlog import DEFAULT_BUFFER_BYTES
from fallbackgate.ledger.db import DEFAULT_LEDGER, ENV_VAR, LedgerError, open_ledger
from fallbackgate.ledger.retry import DEFAULT_RETRY_S
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.policy.apply import policy_from_args
from fallbackgate.recording import RunRecorder

if TYPE_CHECKING:
    from fallbackgate.api_server.service import EngineService

DEFAULT_AUDIT_RATE = 0.1  # without a policy file (a policy's audit.sample_rate otherwise)
API_KEY_VAR = "FALLBACKGATE_API_KEY"  # the key, kept off the command line
DEFAULT_LEDGER_BUFFER_MB = DEFAULT_BUFFER_BYTES / 2**20
DEFAULT_MAX_QUEUED = 128  # requests waiting for a decode slot (each holds its prompt's token ids)


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
    p.add_argument(
        "--max-queued",
        type=int,
        default=DEFAULT_MAX_QUEUED,
        help=f"requests waiting beyond the running ones at most; more get 429 (default {DEFAULT_MAX_QUEUED})",
    )
    p.add_argument(
        "--max-body-mb", type=float, default=1.0, help="largest request body; larger ones get 413 (default 1)"
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=None,
        help="a request still running this long after it arrived is ended (504; recorded as cancelled)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_VAR),
        help=f"require 'Authorization: Bearer KEY' on /v1/ routes (default: ${API_KEY_VAR}; none: open)",
    )
    p.add_argument(
        "--ledger-buffer-mb",
        type=float,
        default=DEFAULT_LEDGER_BUFFER_MB,
        help="records held in memory while the ledger is away, measured; at this bound new requests get 503 "
        f"with Retry-After, admitted ones run on (default {DEFAULT_LEDGER_BUFFER_MB:g})",
    )
    p.add_argument(
        "--ledger-retry-s",
        type=float,
        default=DEFAULT_RETRY_S,
        help=f"seconds the ledger may stay away before the server fails (default {DEFAULT_RETRY_S:g})",
    )
    p.add_argument("--device-budget-mb", type=float, default=None)
    p.add_argument("--host-budget-mb", type=float, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded together at most")
    add_kv_flags(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    p.add_argument("--seed", type=int, default=0)
    add_trace_flag(p)
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be 1..65535, got {args.port}")
    if args.audit_rate is not None and not 0.0 <= args.audit_rate <= 1.0:
        raise ValueError(f"--audit-rate must be in [0, 1], got {args.audit_rate}")
    if args.max_model_len is not None and not 1 <= args.max_model_len <= 1 << 24:
        raise ValueError(f"--max-model-len must be 1..16777216, got {args.max_model_len}")
    if not 0 <= args.audit_workers <= 16:
        raise ValueError(f"--audit-workers must be 0..16, got {args.audit_workers}")
    if not 0.0 <= args.grace_s <= 3600.0:
        raise ValueError(f"--grace-s must be 0..3600, got {args.grace_s}")
    if not 0 <= args.max_queued <= 1_000_000:
        raise ValueError(f"--max-queued must be 0..1000000, got {args.max_queued}")
    if not 0.01 <= args.ledger_buffer_mb <= 65536:
        raise ValueError(f"--ledger-buffer-mb must be 0.01..65536, got {args.ledger_buffer_mb}")
    if not 1.0 <= args.ledger_retry_s <= 86400:
        raise ValueError(f"--ledger-retry-s must be 1..86400, got {args.ledger_retry_s}")
    if not 0.001 <= args.max_body_mb <= 1024:
        raise ValueError(f"--max-body-mb must be 0.001..1024, got {args.max_body_mb}")
    if args.request_timeout_s is not None and not 0.0 < args.request_timeout_s <= 86_400.0:
        raise ValueError(f"--request-timeout-s must be in (0, 86400], got {args.request_timeout_s}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty")
    check_trace_flag(args)


def _setup(args: argparse.Namespace) -> tuple[Assembly, LedgerWriter | None, float]:
    """The assembled engine, the writer (None with --no-ledger) and the fraction of requests audited."""
    is_unaudited = args.audit_rate == 0  # serve's own meaning: record, audit nothing (the schema wants > 0)
    if is_unaudited:
        args.audit_rate = None
    policy = policy_from_args(args, no_policy(audit={"sample_rate": DEFAULT_AUDIT_RATE}))
    buffer_bytes = int(args.ledger_buffer_mb * 2**20)
    writer = None
    if not args.no_ledger:
        ledger = open_ledger(policy.ledger.url)
        writer = LedgerWriter(ledger, buffer_bytes=buffer_bytes, retry_s=args.ledger_retry_s)
    overrides = Overrides(max_new_tokens=16, seed=args.seed, dtype=args.dtype, trace_dir=args.trace)  # tokens:
    # per request in the body
    name = pathlib.Path(args.policy).stem if args.policy is not None else None
    try:
        built = assemble(policy, overrides, policy_name=name, calibration=writer.ledger if writer else None)
    except BaseException:
        if writer is not None:
            writer.close()
        raise
    return built, writer, 0.0 if is_unaudited else built.audit_rate


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate serve``."""
    import uvicorn

    from fallbackgate.api_server.app import build_app
    from fallbackgate.api_server.metrics import ServerMetrics
    from fallbackgate.api_server.routing import ServerInfo
    from fallbackgate.api_server.service import EngineService

    try:
        _check(args)
        built, writer, rate = _setup(args)
    except (PromptsFileError, EngineError, LedgerError, ValueError) as exc:
        print(f"fallbackgate serve: error: {exc}", file=sys.stderr)
        return 2
    engine = built.engine
    recorder = built.recorder(writer, note="serve") if writer is not None else None
    run_id = recorder.run_id if recorder is not None else None
    names = built.policy.classes if built.policy_name is not None else ("default",)
    service = EngineService(
        engine,
        recorder,
        ServerMetrics(),
        classes=names,
        slos=built.classes.slos,
        audit_rate=rate if writer else 0.0,
        seed=args.seed,
        max_queued=args.max_queued,
    )
    workers = _start_audit_workers(args, writer, run_id) if writer is not None and rate > 0 else []

    shutdown = functools.partial(_shut_down, service, recorder, engine, workers, args.grace_s)
    name = pathlib.Path(engine.config.model_dir).name
    info = ServerInfo(
        name,
        run_id,
        built.classes.default,
        shutdown,
        max_body_bytes=int(args.max_body_mb * 2**20),
        request_timeout_s=args.request_timeout_s,
        api_key=args.api_key,
    )
    app = build_app(service, info)
    print(
        f"fallbackgate serve: http://{args.host}:{args.port}/v1 (model {info.model_name!r}, run {run_id})", flush=True
    )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=int(args.grace_s) or None
    )
    with heap.frozen_while_serving():  # no full collection inside an engine step while the server runs
        return 0 if _serve_until_stopped(config, service.stop_admitting) else 3


def _shut_down(
    service: EngineService,
    recorder: RunRecorder | None,
    engine: Engine,
    workers: list[subprocess.Popen],
    grace_s: float,
) -> None:
    """Drain the service, close the run's record and the engine, and wait for the audit workers."""
    status = service.drain(grace_s)
    if recorder is not None:
        recorder.close(status, memory=memory_summary(engine))
    engine.close()
    for proc in workers:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # its claims expire; any `fallbackgate audit` finishes them
    run_id = recorder.run_id if recorder is not None else None
    print(
        f"fallbackgate serve: run {run_id} {status}; {service.num_interrupted} request(s) interrupted, "
        f"{service.num_cancelled} recorded as cancelled"
    )


def _serve_until_stopped(config: Any, on_exit: Callable[[], None]) -> bool:
    """Run uvicorn as ``uvicorn.run`` does (the stop signal it raises again at the end is swallowed); `on_exit`
    is called as soon as a stop signal arrives, before uvicorn waits for the open connections and then closes
    the streams still open. Returns whether the server started (uvicorn.run exits 3 when it did not)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            on_exit()
            super().handle_exit(sig, frame)

    server = Server(config)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return server.started


def _start_audit_workers(args: argparse.Namespace, writer: LedgerWriter, run_id: int | None) -> list[subprocess.Popen]:
    env = {**os.environ, ENV_VAR: writer.ledger.url.render_as_string(hide_password=False)}  # not on a command line
    cmd = [sys.executable, "-m", "fallbackgate", "audit", "--run", str(run_id), "--follow", "--threads", "1"]
    cmd += ["--nice", "19"]
    return [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL) for _ in range(args.audit_workers)]
