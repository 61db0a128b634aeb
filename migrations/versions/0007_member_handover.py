"""Controller members say whom they hand their nodes to (a row re-scoped into racks): the
scope registry lets an overlapping scope lead only beside a leader that hands it over
(docs/operations.md, "Handing nodes over").

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("controller_member") as batch:
        batch.add_column(sa.Column("handing_to", sa.String(length=1024), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("controller_member") as batch:
        batch.drop_column("handing_to")
