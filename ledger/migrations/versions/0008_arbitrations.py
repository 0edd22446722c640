"""arbitrations: one row per dual-miss arbitration (what was late, the options with predicted time and
quality cost, the choice, predicted and measured arrival against the step's deadline, the stall, and the
quality cost the audit measured)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 23:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "arbitrations",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("step_id", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("object_kind", sa.String(16), nullable=False),
        sa.Column("object_id", sa.Integer(), nullable=False),
        sa.Column("late", sa.Text(), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("choice", sa.String(32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("predicted_cost", sa.Float(), nullable=False),
        sa.Column("deadline_s", sa.Float(), nullable=False),
        sa.Column("predicted_arrival_s", sa.Float(), nullable=False),
        sa.Column("measured_arrival_s", sa.Float(), nullable=True),
        sa.Column("stall_s", sa.Float(), nullable=True),
        sa.Column("audited_cost", sa.Float(), nullable=True),
    )
    op.create_index("ix_arbitrations_run_step", "arbitrations", ["run_id", "step_id"])


def downgrade() -> None:
    """Revert this revision."""
    op.drop_index("ix_arbitrations_run_step", table_name="arbitrations")
    op.drop_table("arbitrations")
