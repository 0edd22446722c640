"""kv_copies: the KV store's copy journal (copies of KV blocks written to host or disk, read to serve a
step, freed), in the order the store made the changes; what the audit checks off-device KV events against

Revision ID: 0011
Revises: 0009
Create Date: 2026-12-01 23:50:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "kv_copies",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("step_id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("bits", sa.Integer(), nullable=False),
        sa.Column("block_ids", sa.Text(), nullable=False),
        sa.Column("num_bytes", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_kv_copies_run_request", "kv_copies", ["run_id", "request_id", "seq"])


def downgrade() -> None:
    """Revert this revision."""
    op.drop_index("ix_kv_copies_run_request", table_name="kv_copies")
    op.drop_table("kv_copies")
