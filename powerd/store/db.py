"""Engines and schema migrations: one URL, SQLite or PostgreSQL, same code."""

from __future__ import annotations

import math
import os
from functools import partial
from pathlib import Path
from typing import Any

import structlog
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url

log = structlog.get_logger(__name__)

DEFAULT_URL = "sqlite:///powerd.db"
# An unreachable PostgreSQL host must fail fast: the writer retries with backoff anyway.
PG_CONNECT_TIMEOUT_S = 5
MIGRATIONS_ENV = "POWERD_MIGRATIONS"


def normalize_url(url: str | URL) -> URL:
    """Parse `url`, sending plain `postgresql://` and `postgres://` to the psycopg 3 driver."""
    if isinstance(url, str) and url.startswith("postgres://"):
        url = "postgresql://" + url.removeprefix("postgres://")
    parsed = make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def shown_url(url: str | URL) -> str:
    """The URL as a message may show it: without its password."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return str(url)


def missing_sqlite_file(url: str | URL) -> Path | None:
    """The file of a SQLite URL that is not there (None: there, in memory, or not SQLite).
    A reader refuses it: opening it would create an empty database where a typo pointed."""
    try:
        parsed = make_url(url)
    except Exception:  # make_engine says what is wrong with it
        return None
    path = Path(parsed.database or ":memory:")
    on_disk = parsed.get_backend_name() == "sqlite" and str(path) != ":memory:"
    return path.resolve() if on_disk and not path.is_file() else None


def make_engine(
    url: str | URL = DEFAULT_URL, *, timeout_s: float | None = None, read_only: bool = False
) -> Engine:
    """An engine for `url`. `timeout_s`: every statement gives up after about this long,
    also against a database that stops answering mid-statement (PostgreSQL: connect,
    statement, lock and TCP timeouts; SQLite: the busy timeout) — for callers whose answer
    is worthless late, such as a leader's lease. `read_only`: the database itself refuses
    every write on its connections (PostgreSQL: read-only transactions; SQLite: query_only),
    whichever code path tries one."""
    parsed = normalize_url(url)
    connect_args: dict[str, Any] = {}
    options: list[str] = []
    if parsed.get_backend_name() == "postgresql":
        connect_args["connect_timeout"] = PG_CONNECT_TIMEOUT_S
        if timeout_s is not None:
            ms = max(1, int(timeout_s * 1000))
            connect_args["connect_timeout"] = max(2, math.ceil(timeout_s))
            options += [f"-c statement_timeout={ms}", f"-c lock_timeout={ms}"]
            connect_args["tcp_user_timeout"] = ms
        if read_only:
            options.append("-c default_transaction_read_only=on")
        if options:
            connect_args["options"] = " ".join(options)
    engine = create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)
    if parsed.get_backend_name() == "sqlite":
        busy_ms = 5000 if timeout_s is None else max(1, int(timeout_s * 1000))
        pragmas = partial(_sqlite_pragmas, busy_ms=busy_ms, read_only=read_only)
        event.listen(engine, "connect", pragmas)
    return engine


def _sqlite_pragmas(dbapi_conn: Any, _record: Any, *, busy_ms: int, read_only: bool) -> None:
    # WAL lets the admin API read while the writer thread writes; busy_timeout makes a
    # writer wait briefly for a lock instead of failing at once.
    cur = dbapi_conn.cursor()
    if read_only:
        # Not even the journal mode: a reader changes nothing in someone else's file.
        cur.execute("PRAGMA query_only=ON")
    else:
        cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
    cur.close()


def migrations_dir() -> Path:
    """Where the Alembic scripts live.

    In order: $POWERD_MIGRATIONS; `powerd/_migrations` (a wheel that packages them there);
    `<checkout>/migrations` next to the `powerd` package (a source or editable install).
    """
    package_root = Path(__file__).resolve().parents[1]
    candidates = [package_root / "_migrations", package_root.parent / "migrations"]
    if env := os.environ.get(MIGRATIONS_ENV):
        candidates.insert(0, Path(env))
    for path in candidates:
        if (path / "env.py").is_file():
            return path
    tried = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(f"powerd migrations not found (tried {tried}); set {MIGRATIONS_ENV}")


def alembic_config(url: str | URL | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url is not None:
        # env.py receives the URL object itself, never through the ini parser, where a `%`
        # in an escaped password would be read as interpolation.
        cfg.attributes["url"] = normalize_url(url)
    return cfg


def upgrade(url: str | URL = DEFAULT_URL, revision: str = "head") -> None:
    """Run `alembic upgrade head` (or to `revision`) on the database at `url`."""
    cfg = alembic_config(url)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    finally:
        engine.dispose()
    log.info("store_upgraded", url=normalize_url(url).render_as_string(), revision=revision)


def current_revision(url: str | URL = DEFAULT_URL) -> str | None:
    """The revision the database is at; None for an empty database."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError("no migrations found")
    return head
