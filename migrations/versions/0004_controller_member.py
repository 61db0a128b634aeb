"""Controller members: every controller of a scope (leader or standby) and when it last
said so, on the database's clock.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "controller_member",
        sa.Column("scope", sa.String(length=128), nullable=False),
        sa.Column("holder", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("seen_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("scope", "holder", name="pk_controller_member"),
    )


def downgrade() -> None:
    op.drop_table("controller_member")
