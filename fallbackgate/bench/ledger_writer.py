"""python -m fallbackgate.bench.ledger_writer --json bench-ledger.json [--events 500000] [--pg-url URL | --no-pg]

Events per second through the batched LedgerWriter, end to end (first ``record_step`` to the final
commit), into a fresh SQLite file and into PostgreSQL: the server at ``--pg-url`` (a fresh database
is not created; use an empty one), else a throwaway cluster started from
``/usr/lib/postgresql/*/bin`` when installed. Prints the numbers and writes them as JSON.
Goals (issue 4): >= 200,000 events/s into SQLite, >= 50,000 into PostgreSQL.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import platform
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sqlalchemy

from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.synthetic import synthetic_step
from fallbackgate.ledger.writer import LedgerWriter

GOALS = {"sqlite": 200_000, "postgresql": 50_000}
REQUESTS, LAYERS, EVENTS_PER_LAYER = 8, 16, 4  # 512 events per step


def measure(url: str, num_events: int) -> dict[str, Any]:
    """Write ``num_events`` synthetic events through a LedgerWriter into ``url``; return the timings."""
    per_step = REQUESTS * LAYERS * EVENTS_PER_LAYER
    rids = [f"req-{i}" for i in range(REQUESTS)]
    num_steps = max(1, num_events // per_step)
    # fresh messages per step, built before timing: the writer keeps references until written
    steps = [synthetic_step(s, rids, num_layers=LAYERS, events_per_layer=EVENTS_PER_LAYER) for s in range(num_steps)]
    ledger = open_ledger(url)
    writer = LedgerWriter(ledger)
    writer.start_run(model_path="bench", controller="bench")
    caller = 0.0
    start, cpu_start = time.perf_counter(), time.process_time()
    for plan, result in steps:
        t0 = time.perf_counter()
        writer.record_step(plan, result)
        caller += time.perf_counter() - t0
    writer.finish_run()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    writer.close()
    ledger.close()
    total = num_steps * per_step
    return {
        "events": total,
        "seconds": round(elapsed, 3),
        "events_per_s": round(total / elapsed),
        "cpu_s": round(cpu, 3),  # this process's CPU time (all threads): the machine may be shared
        "events_per_cpu_s": round(total / cpu),
        "caller_us_per_step": round(1e6 * caller / num_steps, 1),
        "events_per_step": per_step,
    }


def _pg_bin() -> Path | None:
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(p.split("/")[4]),
    )
    return Path(found[-1]).parent if found else None


@contextlib.contextmanager
def temp_postgres() -> Iterator[str]:
    """Start a throwaway PostgreSQL cluster (needs Debian's postgresql); yield its URL; remove it."""
    bindir = _pg_bin()
    if bindir is None:
        raise RuntimeError("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb)")
    root = Path(tempfile.mkdtemp(prefix="fallbackgate-bench-pg-"))
    as_pg: list[str] = []
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
        as_pg = ["runuser", "-u", "postgres", "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data, pg_ctl = root / "data", str(bindir / "pg_ctl")

    def run(cmd: list[str]) -> None:
        subprocess.run([*as_pg, *cmd], check=True, capture_output=True, timeout=120)

    run([str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust"])
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1"
    run([pg_ctl, "-D", str(data), "-o", opts, "-l", str(root / "log"), "-w", "start"])
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*as_pg, pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"],
            check=False,
            capture_output=True,
        )
        shutil.rmtree(root, ignore_errors=True)


def _postgres(args: argparse.Namespace) -> dict[str, Any]:
    if args.no_pg:
        return {"skipped": "--no-pg"}
    if args.pg_url:
        return measure(args.pg_url, args.events)
    try:
        with temp_postgres() as url:
            return {
                **measure(url, args.events),
                "server": "throwaway local cluster (fsync on)",
            }
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return {"skipped": str(exc)}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print and write the results."""
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.ledger_writer", description=__doc__.splitlines()[2])
    p.add_argument("--json", default="bench-ledger.json", help="where to write the results")
    p.add_argument("--events", type=int, default=500_000, help="events per database")
    p.add_argument("--pg-url", default=None, help="PostgreSQL URL (an empty database)")
    p.add_argument("--no-pg", action="store_true", help="skip PostgreSQL")
    args = p.parse_args(argv)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_1m": os.getloadavg()[0],
            "python": platform.python_version(),
            "sqlalchemy": sqlalchemy.__version__,
        },
        "goals_events_per_s": GOALS,
    }
    with tempfile.TemporaryDirectory(prefix="fallbackgate-bench-") as tmp:
        results["sqlite"] = measure(str(Path(tmp) / "bench.sqlite"), args.events)
    results["postgresql"] = _postgres(args)
    for db in ("sqlite", "postgresql"):
        r = results[db]
        if "events_per_s" in r:
            goal = "meets" if r["events_per_s"] >= GOALS[db] else "below"
            print(
                f"{db:<11} {r['events_per_s']:>9,} events/s ({r['events']:,} events in {r['seconds']} s; "
                f"{r['events_per_cpu_s']:,} per CPU-second; caller {r['caller_us_per_step']} us/step; "
                f"{goal} goal {GOALS[db]:,})"
            )
        else:
            print(f"{db:<11} skipped: {r['skipped']}")
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
