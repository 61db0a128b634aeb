"""Leader leases: which controller leads a scope, its epoch (a fencing token), and until
when, on the database's clock.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "leader_lease",
        sa.Column("scope", sa.String(length=128), nullable=False),
        sa.Column("holder", sa.String(length=128), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("acquired_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("scope", name="pk_leader_lease"),
    )


def downgrade() -> None:
    op.drop_table("leader_lease")
