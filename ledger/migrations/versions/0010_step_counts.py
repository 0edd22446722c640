"""Exact zero-byte uses as counts on the step's rows instead of one event row per request × layer:
steps.num_resident_expert_uses / num_resident_kv_reads (what the engine counted for the step) and
step_requests.num_resident_expert_uses / resident_expert_uses (the request's resident expert uses, in total
and per layer). NULL on rows recorded before this revision, whose resident uses are event rows.

Revision ID: 0010
Revises: 0007
Create Date: 2026-12-01 23:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | None = None
depends_on: str | None = None

_COLUMNS = {
    "steps": (("num_resident_expert_uses", sa.Integer()), ("num_resident_kv_reads", sa.Integer())),
    "step_requests": (("num_resident_expert_uses", sa.Integer()), ("resident_expert_uses", sa.Text())),
}


def upgrade() -> None:
    """Apply this revision."""
    for table, columns in _COLUMNS.items():
        with op.batch_alter_table(table) as batch:
            for name, kind in columns:
                batch.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    for table, columns in _COLUMNS.items():
        with op.batch_alter_table(table) as batch:
            for name, _ in columns:
                batch.drop_column(name)
