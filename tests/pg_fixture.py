"""A throwaway PostgreSQL server for tests (``from tests.pg_fixture import pg_server_fixture, pg_url_fixture`` in a test
module provides the fixtures ``pg_server`` and ``pg_url``).

Needs Debian's ``postgresql`` package (``/usr/lib/postgresql/*/bin/initdb``). Without it the tests
that use ``pg_url`` are skipped, unless ``FALLBACKGATE_REQUIRE_PG=1`` is set: then they fail.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_counter = itertools.count()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_bin() -> Path | None:
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(p.split("/")[4]),
    )
    return Path(found[-1]).parent if found else None


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _run(cmd: list[str], check: bool = True) -> None:
    subprocess.run(_as_postgres(cmd), check=check, capture_output=True, timeout=60)


@pytest.fixture(scope="session", name="pg_server")
def pg_server_fixture() -> Iterator[tuple[str, int]]:
    """Start a PostgreSQL cluster in a temp dir; yield (host, port); stop and delete it afterwards."""
    bindir = _pg_bin()
    if bindir is None:
        msg = "PostgreSQL not installed (no /usr/lib/postgresql/*/bin/initdb; apt-get install postgresql)"
        if os.environ.get("FALLBACKGATE_REQUIRE_PG") == "1":
            pytest.fail(msg + " and FALLBACKGATE_REQUIRE_PG=1")
        pytest.skip(msg)
    root = Path(tempfile.mkdtemp(prefix="fallbackgate-pg-"))
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
    data, port = root / "data", free_port()
    _run([str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust"])
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    pg_ctl = str(bindir / "pg_ctl")
    _run([pg_ctl, "-D", str(data), "-o", opts, "-l", str(root / "log"), "-w", "start"])
    try:
        yield "127.0.0.1", port
    finally:
        _run([pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"], check=False)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(name="pg_url")
def pg_url_fixture(pg_server: tuple[str, int]) -> str:
    """A fresh, empty database on the throwaway server, as a SQLAlchemy URL."""
    import psycopg

    host, port = pg_server
    name = f"fg_test_{os.getpid()}_{next(_counter)}"
    with psycopg.connect(host=host, port=port, user="postgres", dbname="postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')  # name built from ints above, not from input
    return f"postgresql+psycopg://postgres@{host}:{port}/{name}"
