"""``fallbackgate dashboard [--ledger URL] [--port N] [--address HOST]``: serve the Streamlit dashboard.

Runs ``streamlit run dashboard/app.py`` bound to 127.0.0.1 by default; the ledger URL reaches the app
through the ``FALLBACKGATE_LEDGER`` environment variable. Exit status: streamlit's, or 2 when the
dashboard app or streamlit cannot be found.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import subprocess
import sys
from pathlib import Path
from typing import Any

from fallbackgate.ledger.db import DEFAULT_LEDGER, ENV_VAR, display_url
from fallbackgate.resources import package_dir

APP = package_dir("fallbackgate.dashboard") / "app.py"
SHIPPED_SWEEP = package_dir("fallbackgate") / "sweep_results" / "sweep.json"
ENV_SWEEP = "FALLBACKGATE_SWEEP_JSON"  # what the app reads (fallbackgate.dashboard.sweep_data.ENV_SWEEP)
DEFAULT_ADDRESS = "127.0.0.1"
DEFAULT_PORT = 8501


def add_parser(subparsers: Any) -> None:
    """Register ``dashboard``."""
    p: argparse.ArgumentParser = subparsers.add_parser("dashboard", help="serve the ledger dashboard (Streamlit)")
    p.add_argument(
        "--ledger", default=None, help=f"ledger URL or SQLite path (default: ${ENV_VAR}, else {DEFAULT_LEDGER})"
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument(
        "--sweep",
        default=None,
        help=f"budget-sweep results (a JSON file or a directory of them) for the sweep page (default: the shipped "
        f"results, {SHIPPED_SWEEP})",
    )
    p.add_argument(
        "--address", default=DEFAULT_ADDRESS, help=f"address to bind (default {DEFAULT_ADDRESS}: this machine only)"
    )
    p.set_defaults(func=run)


def streamlit_command(port: int, address: str, app: Path = APP) -> list[str]:
    """The ``streamlit run`` command line for the dashboard."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(app),
        "--server.headless",
        "true",
        "--server.address",
        address,
        "--server.port",
        str(port),
        "--browser.gatherUsageStats",
        "false",
    ]


def dashboard_env(ledger: str | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for the app: ``base`` (default: this process's) with ``FALLBACKGATE_LEDGER`` set."""
    env = dict(os.environ if base is None else base)
    if ledger:
        env[ENV_VAR] = ledger
    return env


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate dashboard``: run streamlit until it exits."""
    if importlib.util.find_spec("streamlit") is None:
        print("fallbackgate dashboard: error: streamlit is not installed (pip install streamlit)", file=sys.stderr)
        return 2
    if not APP.is_file():
        print(f"fallbackgate dashboard: error: dashboard app not found at {APP}", file=sys.stderr)
        return 2
    env = dashboard_env(args.ledger)
    sweep = args.sweep or env.get(ENV_SWEEP) or str(SHIPPED_SWEEP)
    if not pathlib.Path(sweep).exists():
        print(f"fallbackgate dashboard: error: --sweep {sweep}: no such file or directory", file=sys.stderr)
        return 2
    env[ENV_SWEEP] = sweep
    shown = display_url(env.get(ENV_VAR, DEFAULT_LEDGER))  # never a password on stdout
    print(f"fallbackgate dashboard: http://{args.address}:{args.port} (ledger {shown})")
    try:
        return subprocess.call(streamlit_command(args.port, args.address), env=env)
    except KeyboardInterrupt:
        return 0
