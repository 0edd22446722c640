"""runs.memory (the run's memory account: budgets, peak pool bytes by kind, dense bytes, dtype),
runs.numeric_floor (the exact-vs-exact control's statistics) and position_diffs.exact_top2_gap

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 04:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("memory", sa.JSON(none_as_null=True), nullable=True))
        batch.add_column(sa.Column("numeric_floor", sa.JSON(none_as_null=True), nullable=True))
    with op.batch_alter_table("position_diffs") as batch:
        batch.add_column(sa.Column("exact_top2_gap", sa.Float(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("position_diffs") as batch:
        batch.drop_column("exact_top2_gap")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("numeric_floor")
        batch.drop_column("memory")
