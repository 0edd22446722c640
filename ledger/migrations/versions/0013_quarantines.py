"""quarantines: checkpoint objects whose reads failed twice (the files, tensors, both hashes) and the requests
each one touched (failed, deferred, or left unauditable)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02 06:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "quarantines",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("request_id", sa.String(128), nullable=True),
        sa.Column("object_kind", sa.String(16), nullable=False),
        sa.Column("object_id", sa.String(64), nullable=False),
        sa.Column("effect", sa.String(16), nullable=False),
        sa.Column("detail", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_quarantines_run_request", "quarantines", ["run_id", "request_id"])


def downgrade() -> None:
    """Revert this revision."""
    op.drop_index("ix_quarantines_run_request", table_name="quarantines")
    op.drop_table("quarantines")
