"""Audit power: what the replay baseline needs and what completeness is checked against.

event_objects (which experts or KV blocks an approximate or rebuild event covered, at what precision, in
which pass), steps.num_events / num_verified, the step_requests table (positions each step computed
per request, whether it sampled, its event and object counts, the KV blocks it read on device per layer),
requests.token_ids, runs.forced_tags,
request_stats.replay_* and position_diffs.replay_kl (served logits against the replay),
verdicts.quality_passed / correctness_passed, and the verifications table (weight copies checked against the
checkpoint), served_logits and audit_tasks (the deferred audit queue)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 11:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None

COLUMNS: dict[str, tuple[tuple[str, sa.types.TypeEngine], ...]] = {
    "steps": (("num_events", sa.Integer()), ("num_verified", sa.Integer())),
    "requests": (("token_ids", sa.JSON(none_as_null=True)),),
    "runs": (("forced_tags", sa.JSON(none_as_null=True)),),
    "request_stats": (
        ("replay_max_kl", sa.Float()),
        ("replay_mean_kl", sa.Float()),
        ("replay_max_position", sa.Integer()),
        ("replay_top1_agreement", sa.Float()),
    ),
    "position_diffs": (("replay_kl", sa.Float()),),
    "verdicts": (("quality_passed", sa.Boolean()), ("correctness_passed", sa.Boolean())),
}


def upgrade() -> None:
    """Apply this revision."""
    for table, columns in COLUMNS.items():
        with op.batch_alter_table(table) as batch:
            for name, kind in columns:
                batch.add_column(sa.Column(name, kind, nullable=True))
    op.create_table(
        "step_requests",
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("step_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("request_id", sa.String(128), primary_key=True),
        sa.Column("start_position", sa.Integer(), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("is_sampled", sa.Boolean(), nullable=False),
        sa.Column("num_events", sa.Integer(), nullable=False),
        sa.Column("num_objects", sa.Integer(), nullable=False),
        sa.Column("kv_resident_reads", sa.Text(), nullable=True),
    )

    op.create_table(
        "verifications",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("step_id", sa.Integer(), nullable=True),
        sa.Column("object_kind", sa.String(16), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("tier", sa.String(16), nullable=True),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
    )
    op.create_index("ix_verifications_run", "verifications", ["run_id", "passed"])
    _create_audit_queue()
    op.create_table(
        "event_objects",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step_id", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("object_kind", sa.String(16), nullable=False),
        sa.Column("tag", sa.String(32), nullable=False),
        sa.Column("bits", sa.Integer(), nullable=False),
        sa.Column("is_rebuild", sa.Boolean(), nullable=False),
        sa.Column("object_ids", sa.Text(), nullable=False),
    )
    op.create_index("ix_event_objects_run_request", "event_objects", ["run_id", "request_id", "step_id"])


def _create_audit_queue() -> None:
    run_fk = sa.ForeignKey("runs.id", ondelete="CASCADE")
    op.create_table(
        "served_logits",
        sa.Column("run_id", sa.Integer(), run_fk, primary_key=True),
        sa.Column("request_id", sa.String(128), primary_key=True),
        sa.Column("position", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("logits", sa.LargeBinary(), nullable=False),
    )
    op.create_table(
        "audit_tasks",
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("request_id", sa.String(128), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("fencing_token", sa.Integer(), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("worker", sa.String(128), nullable=True),
        sa.Column("num_attempts", sa.Integer(), nullable=False),
        sa.Column("done_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_audit_tasks_state", "audit_tasks", ["state", "run_id"])


def downgrade() -> None:
    """Revert this revision."""
    op.drop_index("ix_event_objects_run_request", table_name="event_objects")
    op.drop_table("event_objects")
    op.drop_index("ix_audit_tasks_state", table_name="audit_tasks")
    op.drop_table("audit_tasks")
    op.drop_table("served_logits")
    op.drop_index("ix_verifications_run", table_name="verifications")
    op.drop_table("verifications")
    op.drop_table("step_requests")
    for table, columns in reversed(COLUMNS.items()):
        with op.batch_alter_table(table) as batch:
            for name, _ in reversed(columns):
                batch.drop_column(name)
