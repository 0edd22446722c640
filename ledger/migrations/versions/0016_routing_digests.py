"""step_requests.routing_digests: per layer, a 64-bit digest of the experts the step's own forward routed the
request's tokens to, so the audit's replay follows the served routing where a router near-tie (a gap of a
rounding error between the k-th and the next expert) went the other way under other kernel shapes; and
request_stats.replay_routing_swaps: how many tokens the replay routed so

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04 19:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("step_requests") as batch:
        batch.add_column(sa.Column("routing_digests", sa.Text(), nullable=True))
    with op.batch_alter_table("request_stats") as batch:
        batch.add_column(sa.Column("replay_routing_swaps", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("request_stats") as batch:
        batch.drop_column("replay_routing_swaps")
    with op.batch_alter_table("step_requests") as batch:
        batch.drop_column("routing_digests")
