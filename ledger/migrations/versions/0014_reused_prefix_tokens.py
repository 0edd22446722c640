"""requests.num_reused_tokens: prompt positions whose KV a request adopted from kept prefix blocks (their
prefill skipped); the audit's coverage counts them as computed, and the baselines recompute them from tokens

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02 05:50:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("num_reused_tokens", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("num_reused_tokens")
