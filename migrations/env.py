"""Alembic environment for powerd's store.

`powerd.store.upgrade(url)` hands in an open connection (`config.attributes["connection"]`).
Run by hand (`alembic -c <ini with script_location = migrations>`), it takes the database
from `-x db=URL`, then $POWERD_DB, then the default SQLite file.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection

from powerd.store.db import DEFAULT_URL, make_engine, normalize_url
from powerd.store.tables import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    if (url := config.attributes.get("url")) is not None:
        return str(url.render_as_string(hide_password=False))
    return context.get_x_argument(as_dictionary=True).get("db") or os.environ.get(
        "POWERD_DB", DEFAULT_URL
    )


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds tables so that later
        # migrations are written once for both backends.
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    """`--sql`: print the DDL for a DBA instead of running it."""
    context.configure(
        url=normalize_url(_url()),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.begin() as conn:
            _configure(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
