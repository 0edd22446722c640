"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-29 08:33:00.238182
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "calibrations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tag", sa.String(length=32), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("scale", sa.Float(), nullable=False),
        sa.Column("fitted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("num_samples", sa.Integer(), nullable=False),
        sa.Column("run_ids", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_calibrations_tag_layer",
        "calibrations",
        ["tag", "layer", "fitted_at"],
        unique=False,
    )

    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("policy", sa.Text(), nullable=True),
        sa.Column("model_path", sa.Text(), nullable=True),
        sa.Column("hardware_profile", sa.JSON(), nullable=True),
        sa.Column("versions", sa.JSON(), nullable=True),
        sa.Column("controller", sa.String(length=64), nullable=True),
        sa.Column("mode", sa.String(length=16), nullable=True),
        sa.Column("numeric_floor_kl", sa.Float(), nullable=True),
        sa.Column("note", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_runs_started_at", "runs", ["started_at"], unique=False)

    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step_id", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("object_kind", sa.String(length=16), nullable=False),
        sa.Column("tag", sa.String(length=32), nullable=False),
        sa.Column("exactness", sa.String(length=16), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("bytes_moved", sa.BigInteger(), nullable=False),
        sa.Column("source_tier", sa.String(length=16), nullable=True),
        sa.Column("predicted_cost", sa.Float(), nullable=False),
        sa.Column("modeled_s", sa.Float(), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_events_run_request_step",
        "events",
        ["run_id", "request_id", "step_id"],
        unique=False,
    )
    op.create_index("ix_events_run_tag", "events", ["run_id", "tag"], unique=False)

    op.create_table(
        "position_diffs",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("position", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("step_id", sa.Integer(), nullable=True),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("kl", sa.Float(), nullable=False),
        sa.Column("top1_agree", sa.Boolean(), nullable=False),
        sa.Column("delta_p", sa.Float(), nullable=False),
        sa.Column("max_abs_dlogit", sa.Float(), nullable=False),
        sa.Column("vllm_top5_ok", sa.Boolean(), nullable=False),
        sa.Column("logp_exact", sa.Float(), nullable=False),
        sa.Column("logp_engine", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "request_id", "position"),
    )
    op.create_table(
        "request_stats",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("num_positions", sa.Integer(), nullable=False),
        sa.Column("mean_kl", sa.Float(), nullable=False),
        sa.Column("median_kl", sa.Float(), nullable=False),
        sa.Column("p99_kl", sa.Float(), nullable=False),
        sa.Column("max_kl", sa.Float(), nullable=False),
        sa.Column("sem_kl", sa.Float(), nullable=False),
        sa.Column("top1_agreement", sa.Float(), nullable=False),
        sa.Column("rms_delta_p", sa.Float(), nullable=False),
        sa.Column("ppl_ratio", sa.Float(), nullable=False),
        sa.Column("first_divergence", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "request_id"),
    )
    op.create_table(
        "requests",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("request_class", sa.String(length=64), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=True),
        sa.Column("num_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("num_output_tokens", sa.Integer(), nullable=False),
        sa.Column("num_preemptions", sa.Integer(), nullable=False),
        sa.Column("slo", sa.JSON(), nullable=True),
        sa.Column("budget", sa.JSON(), nullable=True),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("tpot_s", sa.Float(), nullable=True),
        sa.Column("modeled_ttft_s", sa.Float(), nullable=True),
        sa.Column("modeled_tpot_s", sa.Float(), nullable=True),
        sa.Column("verdict", sa.String(length=16), nullable=True),
        sa.Column("tag_counts", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ux_requests_run_request", "requests", ["run_id", "request_id"], unique=True)

    op.create_table(
        "steps",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("num_requests", sa.Integer(), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("is_observe", sa.Boolean(), nullable=False),
        sa.Column("wall_s", sa.Float(), nullable=False),
        sa.Column("modeled_s", sa.Float(), nullable=False),
        sa.Column("device_bytes_expert", sa.BigInteger(), nullable=False),
        sa.Column("device_bytes_kv", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "step_id"),
    )
    op.create_table(
        "verdicts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=True),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("first_divergence_position", sa.Integer(), nullable=True),
        sa.Column("first_divergence_step", sa.Integer(), nullable=True),
        sa.Column("first_divergence_layer", sa.Integer(), nullable=True),
        sa.Column("first_divergence_tags", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_verdicts_run_request", "verdicts", ["run_id", "request_id"], unique=False)


def downgrade() -> None:
    """Revert this revision."""
    op.drop_index("ix_verdicts_run_request", table_name="verdicts")

    op.drop_table("verdicts")
    op.drop_table("steps")
    op.drop_index("ux_requests_run_request", table_name="requests")

    op.drop_table("requests")
    op.drop_table("request_stats")
    op.drop_table("position_diffs")
    op.drop_index("ix_events_run_tag", table_name="events")
    op.drop_index("ix_events_run_request_step", table_name="events")

    op.drop_table("events")
    op.drop_index("ix_runs_started_at", table_name="runs")

    op.drop_table("runs")
    op.drop_index("ix_calibrations_tag_layer", table_name="calibrations")

    op.drop_table("calibrations")
