"""Operator state (temporary budgets, pins, drains, class assignments, a policy replaced
through the API) by revision, and a key per audit row so a row queued during a database
outage and re-sent after a restart is written once.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "operator_state",
        sa.Column("revision", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("ts", sa.Double(), nullable=False),
        sa.Column("state", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("revision", name="pk_operator_state"),
    )
    with op.batch_alter_table("audit_log") as batch:
        batch.add_column(sa.Column("key", sa.String(length=64), nullable=True))
    op.create_index("ix_audit_log_key", "audit_log", ["key"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_audit_log_key", table_name="audit_log")
    with op.batch_alter_table("audit_log") as batch:
        batch.drop_column("key")
    op.drop_table("operator_state")
