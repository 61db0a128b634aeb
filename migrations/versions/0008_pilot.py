"""What a pilot report needs (`powerd pilot report`, docs/operations.md, "Pilot"): the
workload's reported throughput per GPU and minute, each budget group's committed caps and
measured draw per minute, and every run of draw above a budget.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("gpu_minutes") as batch:
        batch.add_column(sa.Column("mean_perf", sa.Double(), nullable=True))
        batch.add_column(
            sa.Column("perf_samples", sa.Integer(), server_default=sa.text("0"), nullable=False)
        )
    op.create_table(
        "group_minutes",
        sa.Column("group", sa.String(length=128), nullable=False),
        sa.Column("minute", sa.BigInteger(), nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("budget_w", sa.Double(), nullable=True),
        sa.Column("limit_w", sa.Double(), nullable=True),
        sa.Column("mean_committed_w", sa.Double(), nullable=False),
        sa.Column("max_committed_w", sa.Double(), nullable=False),
        sa.Column("mean_draw_w", sa.Double(), nullable=False),
        sa.Column("max_draw_w", sa.Double(), nullable=False),
        sa.Column("over_s", sa.Double(), nullable=False),
        sa.Column("ticks", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("group", "minute", name=op.f("pk_group_minutes")),
    )
    op.create_index(op.f("ix_group_minutes_minute"), "group_minutes", ["minute"], unique=False)
    op.create_table(
        "budget_excursions",
        sa.Column("id", Id, autoincrement=True, nullable=False),
        sa.Column("group", sa.String(length=128), nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("start_ts", sa.Double(), nullable=False),
        sa.Column("end_ts", sa.Double(), nullable=False),
        sa.Column("peak_draw_w", sa.Double(), nullable=False),
        sa.Column("peak_excess_w", sa.Double(), nullable=False),
        sa.Column("budget_w", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_budget_excursions")),
    )
    op.create_index(
        op.f("ix_budget_excursions_start_ts"), "budget_excursions", ["start_ts"], unique=False
    )
    op.create_index(
        op.f("ix_budget_excursions_group_start_ts"),
        "budget_excursions",
        ["group", "start_ts"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_table("budget_excursions")
    op.drop_table("group_minutes")
    with op.batch_alter_table("gpu_minutes") as batch:
        batch.drop_column("perf_samples")
        batch.drop_column("mean_perf")
