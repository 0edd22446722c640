"""step_requests.rebuild_objects: objects the step's KV rebuild pass computed for the request (the events
with ``is_rebuild``), so a ``recompute`` KV event can be reconciled with the pass that rebuilt its blocks
even when every action in that pass was exact (exact events name no objects, so event_objects has no row)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("step_requests") as batch:
        batch.add_column(sa.Column("rebuild_objects", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("step_requests") as batch:
        batch.drop_column("rebuild_objects")
