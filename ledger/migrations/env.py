"""Alembic environment of the ledger; run programmatically by ``fallbackgate.ledger.db`` (no alembic.ini)."""

from __future__ import annotations

from alembic import context

from fallbackgate.ledger.models import Base

target_metadata = Base.metadata


def run_migrations_online() -> None:
    """Run migrations on the connection handed over in ``config.attributes["connection"]``."""
    connection = context.config.attributes["connection"]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise RuntimeError("the ledger's migrations run online only (ledger.db.upgrade)")
run_migrations_online()
