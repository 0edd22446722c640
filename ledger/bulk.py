"""Bulk inserts: the fastest path each database offers for many rows in one transaction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Table, insert


def insert_rows(
    conn: Connection, table: Table, rows: Sequence[Any], columns: Sequence[str]
) -> None:
    """Insert ``rows`` into ``table`` inside ``conn``'s transaction.

    Dict rows go through a Core ``insert()`` executemany. Tuple rows (values in ``columns`` order,
    plain Python scalars only) use the driver directly: ``executemany`` of the Core-compiled INSERT on
    SQLite, ``COPY ... FROM STDIN`` on PostgreSQL with psycopg 3, Core executemany elsewhere.
    """
    if not rows:
        return
    if not isinstance(rows[0], tuple):
        conn.execute(insert(table), list(rows))
        return
    dialect = conn.dialect
    if dialect.name == "sqlite":
        stmt = insert(table).compile(dialect=dialect, column_keys=list(columns))
        conn.exec_driver_sql(str(stmt), list(rows))
    elif dialect.name == "postgresql" and dialect.driver == "psycopg":
        prep = dialect.identifier_preparer
        cols = ", ".join(prep.quote(c) for c in columns)
        dbapi_conn: Any = conn.connection.driver_connection
        with (
            dbapi_conn.cursor() as cur,
            cur.copy(f"COPY {prep.format_table(table)} ({cols}) FROM STDIN") as cp,
        ):
            for row in rows:
                cp.write_row(row)
    else:
        conn.execute(insert(table), [dict(zip(columns, r, strict=True)) for r in rows])
