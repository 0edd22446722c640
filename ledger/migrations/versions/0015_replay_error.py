"""request_stats.replay_error: why the replay could not follow a request's ledger trace (rows missing, or
contradicting the served tokens), kept so the verdict names the cause instead of an infinite KL alone

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-03 11:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("request_stats") as batch:
        batch.add_column(sa.Column("replay_error", sa.Text(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("request_stats") as batch:
        batch.drop_column("replay_error")
