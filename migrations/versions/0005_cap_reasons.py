"""Cap reasons: why each stored cap change was what it was (`powerd why`, docs/api.md).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "cap_reasons",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("ts", sa.Double(), nullable=False),
        sa.Column("tick", sa.BigInteger(), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=128), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("decided_by", sa.String(length=128), nullable=False),
        sa.Column("sent_w", sa.Double(), nullable=True),
        sa.Column("target_w", sa.Double(), nullable=True),
        sa.Column("committed_w", sa.Double(), nullable=True),
        sa.Column("budget_group", sa.String(length=128), nullable=False),
        sa.Column("budget_w", sa.Double(), nullable=True),
        sa.Column("limit_w", sa.Double(), nullable=True),
        sa.Column("group_committed_w", sa.Double(), nullable=True),
        sa.Column("price_per_kw", sa.Double(), nullable=True),
        sa.Column("demand_w", sa.Double(), nullable=True),
        sa.Column("power_w", sa.Double(), nullable=True),
        sa.Column("reported_cap_w", sa.Double(), nullable=True),
        sa.Column("sample_age_s", sa.Double(), nullable=True),
        sa.Column("sample_seq", sa.BigInteger(), nullable=True),
        sa.Column("lo_w", sa.Double(), nullable=True),
        sa.Column("hi_w", sa.Double(), nullable=True),
        sa.Column("more", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_cap_reasons"),
    )
    op.create_index("ix_cap_reasons_ts", "cap_reasons", ["ts"])
    op.create_index("ix_cap_reasons_gpu_uuid_ts", "cap_reasons", ["gpu_uuid", "ts"])


def downgrade() -> None:
    op.drop_index("ix_cap_reasons_gpu_uuid_ts", table_name="cap_reasons")
    op.drop_index("ix_cap_reasons_ts", table_name="cap_reasons")
    op.drop_table("cap_reasons")
