"""kv_copies.code_checksums: the xxh3-64 of each quantized KV block's integer codes as the engine wrote the copy
it served kv_dequant reads from; the replay checks the codes it rebuilds against them

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 06:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("kv_copies") as batch:
        batch.add_column(sa.Column("code_checksums", sa.Text(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("kv_copies") as batch:
        batch.drop_column("code_checksums")
