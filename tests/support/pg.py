"""A throwaway PostgreSQL database per test, on the server CI starts.

The server comes from $POWERD_TEST_PG_URL, as README and .ci/run set it (default:
127.0.0.1:5432, user postgres, trust auth). When it cannot be reached, tests that need it
fail with a message that says so: a silent skip would let CI pass without ever testing
PostgreSQL.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

from support.needs import POSTGRES_EVENT

ADMIN_URL = os.environ.get("POWERD_TEST_PG_URL") or "postgresql://postgres@127.0.0.1:5432/postgres"

# The two stores, as parameters of a fixture or a test: the PostgreSQL one marked `postgres`.
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


def _admin() -> psycopg.Connection[tuple[object, ...]]:
    try:
        conn = psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(
            f"PostgreSQL is not reachable at {ADMIN_URL} ({exc}). These tests need a real "
            "server: start one (CI does) or point $POWERD_TEST_PG_URL at one.",
            pytrace=False,
        )
    sys.audit(POSTGRES_EVENT, ADMIN_URL)  # the marks' guard (support/needs.py) sees it
    return conn


def unique_name() -> str:
    return f"powerd_test_{uuid.uuid4().hex[:12]}"


def url_for(name: str) -> str:
    """A plain postgresql:// URL, as an operator would write it (the store maps the driver)."""
    return make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)


def create_database(name: str) -> None:
    with _admin() as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(name: str) -> None:
    with _admin() as conn:
        # FORCE: a pooled connection left open by a failed test must not keep it alive.
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@contextmanager
def pg_database(*, create: bool = True) -> Iterator[str]:
    """Yield the URL of a new, empty database (or of a name not created yet); drop it after."""
    name = unique_name()
    if create:
        create_database(name)
    try:
        yield url_for(name)
    finally:
        drop_database(name)
