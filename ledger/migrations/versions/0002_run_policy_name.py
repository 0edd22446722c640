"""runs.policy_name: which policy file governed a run

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 11:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("policy_name", sa.String(length=128), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("policy_name")
