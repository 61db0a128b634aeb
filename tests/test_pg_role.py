"""deploy/postgres/create-role.sql, run by psql as an operator runs it, on the real server:
the role migrates and uses its database and nothing else, the reader only reads, and a
second run changes nothing."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url
from support.cli import powerd
from support.pg import ADMIN_URL, unique_name

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "deploy" / "postgres" / "create-role.sql"
PASSWORD = "role-test-0123456789abcdef"

pytestmark = [pytest.mark.postgres, pytest.mark.process]


def url(role: str, db: str) -> str:
    return (
        make_url(ADMIN_URL)
        .set(username=role, password=PASSWORD, database=db)
        .render_as_string(hide_password=False)
    )


def psql(*variables: str) -> subprocess.CompletedProcess[str]:
    args = ["psql", ADMIN_URL, "-X", "-q", "-v", "ON_ERROR_STOP=1"]
    for v in variables:
        args += ["-v", v]
    return subprocess.run(
        [*args, "-f", str(SCRIPT)], capture_output=True, text=True, check=False, timeout=60
    )


@pytest.fixture
def names() -> Iterator[tuple[str, str, str]]:
    role, db, reader = unique_name(), unique_name(), unique_name()
    try:
        yield role, db, reader
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db))
            )
            for r in (reader, role):
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(r)))


def refused(conn: psycopg.Connection[tuple[object, ...]], statement: str) -> str:
    """The error class a statement ends with (it must fail)."""
    with pytest.raises(psycopg.Error) as info:
        conn.execute(statement)
    return type(info.value).__name__


def test_the_role_migrates_its_database_and_can_do_nothing_else(
    names: tuple[str, str, str],
) -> None:
    role, db, reader = names
    variables = (f"role={role}", f"db={db}", f"reader={reader}", f"password={PASSWORD}")
    first = psql(*variables)
    assert first.returncode == 0, first.stderr
    again = psql(*variables)  # idempotent: an operator may run it twice
    assert again.returncode == 0, again.stderr

    migrated = powerd("db", "upgrade", "--db", url(role, db))
    assert migrated.returncode == 0, migrated.stderr
    store_id = powerd("db", "id", "--db", url(role, db))
    assert store_id.returncode == 0 and store_id.stdout.strip(), store_id.stderr

    with psycopg.connect(url(role, db), autocommit=True) as conn:
        tables = {
            r[0]
            for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'powerd'")
        }
        assert "alembic_version" in tables and len(tables) > 5
        assert conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
        ).fetchone() == (0,)
        assert conn.execute(
            "SELECT rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls "
            "FROM pg_roles WHERE rolname = current_user"
        ).fetchone() == (False, False, False, False, False)
        assert refused(conn, "CREATE TABLE public.intruder (x int)") == "InsufficientPrivilege"
        assert refused(conn, "CREATE DATABASE intruder") == "InsufficientPrivilege"
        assert refused(conn, "CREATE ROLE intruder") == "InsufficientPrivilege"
        assert refused(conn, f'ALTER DATABASE "{db}" CONNECTION LIMIT 1') == "InsufficientPrivilege"
        assert refused(conn, f'DROP DATABASE "{db}"') in ("InsufficientPrivilege", "ObjectInUse")
    # Its database grants CONNECT to it (and the reader) by name, and nothing to PUBLIC
    # (an ACL entry with no name before its `=`).
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        row = admin.execute("SELECT datacl::text FROM pg_database WHERE datname = %s", (db,))
        acl = str(row.fetchone())
    assert f"{role}=c/" in acl and f"{reader}=c/" in acl
    assert re.search(r"[{,]=", acl) is None, acl

    with psycopg.connect(url(reader, db), autocommit=True) as conn:
        (count,) = conn.execute("SELECT count(*) FROM alembic_version").fetchone()
        assert count == 1
        assert refused(conn, "DELETE FROM alembic_version") == "ReadOnlySqlTransaction"
        conn.execute("SET default_transaction_read_only = off")  # a reader may try
        assert refused(conn, "DELETE FROM alembic_version") == "InsufficientPrivilege"
