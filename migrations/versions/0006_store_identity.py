"""Store identity: an id made once, when the database is created (migrated first), that
names this store in every command a controller sends (docs/safety.md, "Authority"). Two
controllers on two databases are two authorities, whatever their epochs say.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    table = op.create_table(
        "store_identity",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("store_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.CheckConstraint("id = 1", name="ck_store_identity_one_row"),
        sa.PrimaryKeyConstraint("id", name="pk_store_identity"),
    )
    op.bulk_insert(table, [{"id": 1, "store_id": uuid.uuid4().hex, "created_at": time.time()}])


def downgrade() -> None:
    op.drop_table("store_identity")
