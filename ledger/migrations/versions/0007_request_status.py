"""requests.status: how a request ended ("finished", or "cancelled" when the server shut down before it
finished; NULL on rows recorded before this revision, all of which finished)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 20:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("status", sa.String(16), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("status")
