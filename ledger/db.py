"""Opening a ledger: URL resolution, engine setup, schema checks and upgrades.

The ledger URL is, in order: the ``url`` argument (a command's ``--ledger``), the environment variable
``FALLBACKGATE_LEDGER``, the SQLite file ``./fallbackgate-ledger.sqlite`` (:data:`DEFAULT_LEDGER`).
Any SQLAlchemy URL works (``postgresql+psycopg://user@host:5432/db``); a bare file path means SQLite.
SQLite ledgers run in WAL mode with foreign keys on. Writers upgrade the schema to the newest
revision on open; readers never write. Every failure is a :class:`LedgerError` with a message that
names the ledger, and a failed open leaves no new file behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

DEFAULT_LEDGER = "./fallbackgate-ledger.sqlite"
ENV_VAR = "FALLBACKGATE_LEDGER"
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
WRITE_TRANSACTION = "fallbackgate_write"
# SQLite page cache per connection, KiB. It fills towards this bound as the file grows and stays there, in the
# writing process: 64 MiB made a serving process grow ~15 KB per request for its first ~4,500 requests; at
# 4 MiB it is full within the first few hundred and the writer's CPU per event is unchanged (bench.ledger_writer).
SQLITE_CACHE_KIB = 4096
"""Execution option: a SQLite transaction that will write starts with BEGIN IMMEDIATE (see begin_write)."""
_SQLITE_MAGIC = b"SQLite format 3\x00"
_PG_UPGRADE_LOCK = 0x66_67_6C_65_64  # "fgled": advisory lock id held while upgrading
# A server that stops answering (a network partition, no reset) fails a connection within about 10 s rather than
# the kernel's minutes: the writer then keeps its batch and retries (ledger/retry.py).
_PG_CONNECT_ARGS = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,  # milliseconds sent data may stay unacknowledged
}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")


class LedgerError(Exception):
    """A ledger could not be opened or written; the message says which and why."""


@dataclasses.dataclass
class Ledger:
    """An open ledger: a SQLAlchemy engine plus what it was opened as."""

    engine: Engine
    url: URL
    read_only: bool

    @property
    def display_url(self) -> str:
        """The URL with any password hidden, for messages."""
        return self.url.render_as_string(hide_password=True)

    @property
    def is_sqlite(self) -> bool:
        """True for SQLite ledgers."""
        return self.url.get_backend_name() == "sqlite"

    def close(self) -> None:
        """Release all connections."""
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def resolve_url(url: str | None) -> str:
    """The ledger URL to use: ``url``, else ``$FALLBACKGATE_LEDGER``, else :data:`DEFAULT_LEDGER`."""
    if url:
        return url
    return os.environ.get(ENV_VAR) or DEFAULT_LEDGER


def display_url(raw: str) -> str:
    """A ledger URL as it may be shown or logged: any password replaced by ***."""
    try:
        return parse_url(raw).render_as_string(hide_password=True)
    except LedgerError:
        return re.sub(r"(//[^/:@]*:)[^@/]*@", r"\1***@", raw)


def parse_url(raw: str) -> URL:
    """Turn a URL or bare file path into a SQLAlchemy URL; raise LedgerError when malformed."""
    raw = raw.strip()
    if not raw:
        raise LedgerError("ledger URL is empty")
    scheme = _SCHEME.match(raw)
    if scheme is None or len(scheme.group(1)) == 1:  # plain path (or a Windows drive letter)
        return URL.create("sqlite", database=str(Path(raw).expanduser().absolute()))
    if not raw[scheme.end() :].startswith("//"):
        raise LedgerError(f"malformed ledger URL {raw!r}: expected SCHEME://..., e.g. sqlite:///file.sqlite")
    try:
        return make_url(raw)
    except (ArgumentError, ValueError) as exc:
        raise LedgerError(f"malformed ledger URL {raw!r}: {exc}") from None


def alembic_config() -> Config:
    """An Alembic config built in code, pointing at the migrations shipped inside the package."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def head_revision() -> str:
    """The newest schema revision this code knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def _sqlite_file(url: URL) -> Path | None:
    db = url.database
    if not db or db == ":memory:" or db.startswith("file:"):
        return None
    return Path(db)


def _writable(path: Path) -> bool:
    # root passes os.access on anything; a file or folder without write bits is treated as read-only.
    return os.access(path, os.W_OK) and bool(path.stat().st_mode & 0o222)


def _check_sqlite_path(path: Path, read_only: bool) -> None:
    if path.is_dir():
        raise LedgerError(f"ledger path {path} is a directory, not a SQLite file")
    if not path.exists():
        if read_only:
            raise LedgerError(f"no ledger at {path} (the file does not exist)")
        if not path.parent.is_dir():
            raise LedgerError(f"cannot create ledger {path}: directory {path.parent} does not exist")
        if not _writable(path.parent):
            raise LedgerError(f"cannot create ledger {path}: directory {path.parent} is read-only")
        return
    with path.open("rb") as fh:
        head = fh.read(len(_SQLITE_MAGIC))
    if head and head != _SQLITE_MAGIC:
        raise LedgerError(f"ledger {path} is not a SQLite database")
    if not read_only and not (_writable(path) and _writable(path.parent)):
        raise LedgerError(f"ledger {path} is read-only (file or its directory not writable); open it read-only")


def _check_path_kind(path: Path) -> None:
    """An existing path is a SQLite file (checked before any engine touches it)."""
    if path.is_dir():
        raise LedgerError(f"ledger path {path} is a directory, not a SQLite file")
    with path.open("rb") as fh:
        head = fh.read(len(_SQLITE_MAGIC))
    if head and head != _SQLITE_MAGIC:
        raise LedgerError(f"ledger {path} is not a SQLite database")


def _sqlite_engine(url: URL, path: Path | None, read_only: bool) -> Engine:
    kwargs: dict[str, Any] = {}
    if path is None:
        kwargs["poolclass"] = StaticPool
        kwargs["connect_args"] = {"check_same_thread": False}
    elif read_only:
        url = URL.create("sqlite", database=f"file:{path}?mode=ro", query={"uri": "true"})
    engine = create_engine(url, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # let the "begin" hook below own transactions (DDL included)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=10000")
        if not read_only and path is not None:
            cur.execute("PRAGMA page_size=16384")  # new files only (no-op later): ~15% faster bulk inserts
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute(f"PRAGMA cache_size=-{SQLITE_CACHE_KIB}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        immediate = conn.get_execution_options().get(WRITE_TRANSACTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate and not read_only else "BEGIN")

    return engine


def _make_engine(url: URL, read_only: bool) -> Engine:
    try:
        if url.get_backend_name() == "sqlite":
            path = _sqlite_file(url)
            if path is not None:
                _check_sqlite_path(path, read_only)
            return _sqlite_engine(url, path, read_only)
        if url.get_backend_name() != "postgresql":
            return create_engine(url, pool_pre_ping=True)
        engine = create_engine(url, connect_args=_PG_CONNECT_ARGS, pool_pre_ping=True)
        event.listen(engine, "handle_error", _lost_server_is_a_disconnect)
        return engine
    except NoSuchModuleError:
        raise LedgerError(f"unknown database kind {url.drivername!r} in ledger URL") from None
    except ImportError as exc:
        raise LedgerError(f"database driver for {url.drivername!r} is not installed: {exc}") from None
    except ArgumentError as exc:
        raise LedgerError(f"malformed ledger URL: {exc}") from None


def _lost_server_is_a_disconnect(context: Any) -> None:
    """A PostgreSQL operational error (the server shut down or went away, also mid-pipeline, where psycopg leaves
    the connection busy rather than closed) invalidates the connection, so the pool drops it instead of trying to
    roll it back, which fails and logs a traceback; the ledger's writer then retries on a fresh connection."""
    if isinstance(context.sqlalchemy_exception, OperationalError):  # the driver's OperationalError, wrapped
        context.is_disconnect = True


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return text[0] if text else type(orig).__name__


def _check_revision(engine: Engine, display: str, read_only: bool) -> None:
    script = ScriptDirectory.from_config(alembic_config())
    known = {rev.revision for rev in script.walk_revisions()}
    head = script.get_current_head()
    with engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
        tables = inspect(conn).get_table_names() if current is None else []
        has_runs = "runs" in tables
    if current is not None and current not in known:
        raise LedgerError(
            f"ledger {display} has schema revision {current!r}, newer than this fallbackgate knows "
            f"(newest known: {head!r}); upgrade fallbackgate to use it"
        )
    if current is None and (read_only or has_runs):
        raise LedgerError(f"{display} is not a fallbackgate ledger (no schema revision recorded)")
    if current is None and tables:  # another application's database: never write our schema into it
        shown = ", ".join(sorted(tables)[:5])
        raise LedgerError(f"{display} is not a fallbackgate ledger: it holds other tables ({shown}); use a new file")
    if read_only and current != head:
        raise LedgerError(
            f"ledger {display} has old schema revision {current!r} (newest: {head!r}); open it once for "
            "writing (any fallbackgate run) to upgrade it"
        )


@contextlib.contextmanager
def begin_write(engine: Engine) -> Iterator[Connection]:
    """A connection in a write transaction (SQLite: BEGIN IMMEDIATE, so writers queue on the lock
    instead of failing on a read-to-write upgrade); committed on success, rolled back on error."""
    with engine.connect() as conn:
        conn.execution_options(**{WRITE_TRANSACTION: True})
        with conn.begin():
            yield conn


def upgrade(engine: Engine) -> None:
    """Upgrade the schema of ``engine``'s database to the newest revision, in one transaction."""
    cfg = alembic_config()
    with begin_write(engine) as conn:
        if conn.dialect.name == "postgresql":  # concurrent first opens of a shared ledger take turns
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_UPGRADE_LOCK})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def open_ledger(url: str | None = None, *, read_only: bool = False, must_exist: bool = False) -> Ledger:
    """Open the ledger at ``url`` (see :func:`resolve_url`), upgrading its schema unless ``read_only``;
    ``must_exist``: refuse to create a new SQLite file (commands that only read or add to existing runs).

    Raises :class:`LedgerError` for a malformed URL, an unreachable server, a schema newer than this
    code, a read-only file opened for writing, or a file that is not a ledger; nothing is created then.
    """
    sa_url = parse_url(resolve_url(url))
    display = sa_url.render_as_string(hide_password=True)
    path = _sqlite_file(sa_url) if sa_url.get_backend_name() == "sqlite" else None
    existed = path is not None and path.exists()
    if must_exist and path is not None and not existed:
        raise LedgerError(f"no ledger at {path} (the file does not exist)")
    if existed and not read_only:  # look before writing anything (even a journal-mode change)
        _check_path_kind(path)
        probe = _sqlite_engine(sa_url, path, read_only=True)
        try:
            _check_revision(probe, display, read_only=False)
        except (DBAPIError, SQLAlchemyError) as exc:
            raise LedgerError(f"cannot open ledger {display}: {_first_line(exc)}") from None
        finally:
            probe.dispose()
    engine = _make_engine(sa_url, read_only)
    try:
        _check_revision(engine, display, read_only)
        if not read_only:
            upgrade(engine)
    except LedgerError:
        _discard(engine, path, existed)
        raise
    except (DBAPIError, SQLAlchemyError, OSError) as exc:
        _discard(engine, path, existed)
        raise LedgerError(f"cannot open ledger {display}: {_first_line(exc)}") from None
    return Ledger(engine=engine, url=sa_url, read_only=read_only)


def _discard(engine: Engine, path: Path | None, existed: bool) -> None:
    engine.dispose()
    if path is not None and not existed:
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(str(path) + suffix).unlink(missing_ok=True)
