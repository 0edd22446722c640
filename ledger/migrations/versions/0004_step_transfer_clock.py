"""steps: the step's measured expert disk-read time (all of it, and the part the compute thread waited
for) and the next-layer read-ahead's counts (started, used, needed reads it had not started)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 06:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None

COLUMNS = (
    ("transfer_s", sa.Float()),
    ("transfer_exposed_s", sa.Float()),
    ("num_predicted_reads", sa.Integer()),
    ("num_predicted_used", sa.Integer()),
    ("num_unpredicted_reads", sa.Integer()),
)


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("steps") as batch:
        for name, kind in COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("steps") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
