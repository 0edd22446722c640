"""trace_analyses (the numbers ``fallbackgate trace analyze`` finds per trace) and runs.trace_path (the
run's trace directory)

Revision ID: 0009
Revises: 0007 (to be re-chained after 0008_arbitrations)
Create Date: 2026-12-01 22:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("trace_path", sa.Text(), nullable=True))
    op.create_table(
        "trace_analyses",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=True),
        sa.Column("trace_path", sa.Text(), nullable=False),
        sa.Column("workload", sa.String(128), nullable=False),
        sa.Column("analysis", sa.String(32), nullable=False),
        sa.Column("metric", sa.String(64), nullable=False),
        sa.Column("device", sa.String(64), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("ci_low", sa.Float(), nullable=True),
        sa.Column("ci_high", sa.Float(), nullable=True),
        sa.Column("unit", sa.String(32), nullable=False),
        sa.Column("params", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_trace_analyses_trace", "trace_analyses", ["trace_path", "analysis"])


def downgrade() -> None:
    """Revert this revision."""
    op.drop_index("ix_trace_analyses_trace", table_name="trace_analyses")
    op.drop_table("trace_analyses")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("trace_path")
