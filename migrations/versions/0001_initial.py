"""Initial schema: inventory, tick aggregates, cap changes, events, policy versions, audit log,
per-GPU per-minute aggregates.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# SQLite autoincrements only an INTEGER PRIMARY KEY; PostgreSQL gets 64-bit ids.
ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
NAME = sa.String(length=128)


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("name", NAME, nullable=False),
        sa.Column("row", NAME, nullable=True),
        sa.Column("rack", NAME, nullable=True),
        sa.Column("first_seen", sa.Double(), nullable=False),
        sa.Column("last_seen", sa.Double(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_nodes"),
    )

    op.create_table(
        "gpus",
        sa.Column("uuid", NAME, nullable=False),
        sa.Column("node", NAME, nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("name", NAME, nullable=False),
        sa.Column("min_cap_w", sa.Double(), nullable=False),
        sa.Column("max_cap_w", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("uuid", name="pk_gpus"),
    )
    op.create_index("ix_gpus_node", "gpus", ["node"])

    op.create_table(
        "ticks",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("tick", sa.BigInteger(), nullable=False),
        sa.Column("ts", sa.Double(), nullable=False),
        sa.Column("budget_w", sa.Double(), nullable=False),
        sa.Column("committed_w", sa.Double(), nullable=False),
        sa.Column("measured_w", sa.Double(), nullable=False),
        sa.Column("throughput", sa.Double(), nullable=False),
        sa.Column("solve_ms", sa.Double(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("solver", sa.String(length=32), nullable=False),
        sa.Column("n_gpus", sa.Integer(), nullable=False),
        sa.Column("n_stale", sa.Integer(), nullable=False),
        sa.Column("rows", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_ticks"),
    )
    op.create_index("ix_ticks_ts", "ticks", ["ts"])

    op.create_table(
        "cap_changes",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("ts", sa.Double(), nullable=False),
        sa.Column("tick", sa.BigInteger(), nullable=False),
        sa.Column("gpu_uuid", NAME, nullable=False),
        sa.Column("node", NAME, nullable=False),
        sa.Column("old_w", sa.Double(), nullable=True),
        sa.Column("new_w", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_cap_changes"),
    )
    op.create_index("ix_cap_changes_ts", "cap_changes", ["ts"])
    op.create_index("ix_cap_changes_gpu_uuid_ts", "cap_changes", ["gpu_uuid", "ts"])

    op.create_table(
        "events",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("ts", sa.Double(), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("cleared_at", sa.Double(), nullable=True),
        sa.CheckConstraint("severity IN ('info', 'warning', 'alarm')", name="ck_events_severity"),
        sa.PrimaryKeyConstraint("id", name="pk_events"),
    )
    op.create_index("ix_events_ts", "events", ["ts"])
    op.create_index("ix_events_kind_cleared_at", "events", ["kind", "cleared_at"])

    op.create_table(
        "policy_versions",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("ts", sa.Double(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("source", sa.String(length=1024), nullable=False),
        sa.Column("yaml_text", sa.Text(), nullable=False),
        sa.Column("author", NAME, nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("version", name="pk_policy_versions"),
    )
    # At most one active version; a partial unique index works on both backends.
    op.create_index(
        "uq_policy_versions_one_active",
        "policy_versions",
        ["active"],
        unique=True,
        sqlite_where=sa.text("active"),
        postgresql_where=sa.text("active"),
    )

    op.create_table(
        "audit_log",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("ts", sa.Double(), nullable=False),
        sa.Column("actor", NAME, nullable=False),
        sa.Column("role", sa.String(length=32), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=256), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("result", sa.String(length=256), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_audit_log"),
    )
    op.create_index("ix_audit_log_ts", "audit_log", ["ts"])

    op.create_table(
        "gpu_minutes",
        sa.Column("uuid", NAME, nullable=False),
        sa.Column("minute", sa.BigInteger(), nullable=False),
        sa.Column("mean_power_w", sa.Double(), nullable=False),
        sa.Column("max_power_w", sa.Double(), nullable=False),
        sa.Column("energy_j", sa.Double(), nullable=False),
        sa.Column("mean_cap_w", sa.Double(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("uuid", "minute", name="pk_gpu_minutes"),
    )
    op.create_index("ix_gpu_minutes_minute", "gpu_minutes", ["minute"])


def downgrade() -> None:
    for table in (
        "gpu_minutes",
        "audit_log",
        "policy_versions",
        "events",
        "cap_changes",
        "ticks",
        "gpus",
        "nodes",
    ):
        op.drop_table(table)  # drops its indexes with it
