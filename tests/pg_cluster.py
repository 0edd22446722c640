"""A PostgreSQL cluster of a test's own, which the test may stop and start (the shared ``pg_server`` of
``tests.pg_fixture`` is for tests that leave the server alone).

``with pg_cluster() as cluster:`` yields a :class:`Cluster` with a fresh database at ``cluster.url``; it is
skipped where PostgreSQL is not installed, as ``tests.pg_fixture`` skips.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg_fixture import _as_postgres, _pg_bin, free_port


@dataclasses.dataclass
class Cluster:
    """One running (or stopped) PostgreSQL cluster on 127.0.0.1."""

    bindir: Path  # PostgreSQL's programs
    root: Path  # data directory's parent, socket directory and log
    port: int  # TCP port on 127.0.0.1

    @property
    def url(self) -> str:
        """The test database, as a SQLAlchemy URL."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/fg_outage"

    def new_database(self, name: str) -> str:
        """Create an empty database ``name`` (a test's own, on a shared cluster); its SQLAlchemy URL."""
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')  # names come from the tests, not from input
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def _ctl(self, *args: str) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        cmd = [str(self.bindir / "pg_ctl"), "-D", str(self.root / "data"), "-o", opts, "-l", str(self.root / "log")]
        subprocess.run(_as_postgres([*cmd, *args]), check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        self._ctl("-w", "start")

    def stop(self) -> None:
        """Fast shutdown: open sessions are terminated, transactions not committed roll back."""
        self._ctl("-m", "fast", "-w", "stop")


@contextlib.contextmanager
def pg_cluster() -> Iterator[Cluster]:
    """A new cluster with an empty database ``fg_outage``; stopped and deleted afterwards."""
    bindir = _pg_bin()
    if bindir is None:
        if os.environ.get("FALLBACKGATE_REQUIRE_PG") == "1":
            pytest.fail("PostgreSQL not installed and FALLBACKGATE_REQUIRE_PG=1")
        pytest.skip("PostgreSQL not installed (no /usr/lib/postgresql/*/bin/initdb)")
    root = Path(tempfile.mkdtemp(prefix="fallbackgate-pg-outage-"))
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
    cluster = Cluster(bindir, root, free_port())
    initdb = [str(bindir / "initdb"), "-D", str(root / "data"), "-U", "postgres", "--auth=trust"]
    subprocess.run(_as_postgres(initdb), check=True, capture_output=True, timeout=60)
    cluster.start()
    try:
        cluster.new_database("fg_outage")
        yield cluster
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
