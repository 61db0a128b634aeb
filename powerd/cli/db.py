"""`powerd db upgrade` and `powerd db id`: the store's schema and its id."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from powerd.cli.exits import EXIT_FAILED, EXIT_OK

DEFAULT_DB_URL = "sqlite:///powerd.db"


def cmd_db_id(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from powerd.store import Store

    try:
        store_id = Store(args.db).store_id()
    except SQLAlchemyError as exc:
        print(
            f"powerd db id: {args.db}: {exc.__class__.__name__}: {str(exc).splitlines()[0]}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if store_id is None:
        print(f"powerd db id: {args.db} has no id yet: run `powerd db upgrade`", file=sys.stderr)
        return EXIT_FAILED
    print(store_id)
    return EXIT_OK


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from powerd.store import current_revision, head_revision, upgrade

    try:
        before = current_revision(args.db)
        upgrade(args.db)
        after = current_revision(args.db)
    except SQLAlchemyError as exc:
        print(
            f"powerd db upgrade: cannot migrate {args.db}: {exc.__class__.__name__}: "
            f"{str(exc).splitlines()[0]}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if before == after:
        print(f"{args.db}: already at {after} (head {head_revision()})")
    else:
        print(f"{args.db}: migrated {before or 'empty'} -> {after}")
    return EXIT_OK


def add_parser(sub: Any) -> None:
    """Register `powerd db` and its actions on the top-level subparsers."""
    db = sub.add_parser("db", help="database maintenance")
    db_sub = db.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    up = db_sub.add_parser("upgrade", help="run the migrations up to the newest schema")
    up.add_argument(
        "--db",
        default=os.environ.get("POWERD_DB", DEFAULT_DB_URL),
        help="SQLAlchemy URL, e.g. sqlite:///powerd.db or postgresql://user@host/db "
        "(default: $POWERD_DB or %(default)s)",
    )
    up.set_defaults(handler=cmd_db_upgrade, needs="controller")
    ident = db_sub.add_parser(
        "id", help="print the store's id (an authority's `store`, for `powerd handover`)"
    )
    ident.add_argument("--db", default=os.environ.get("POWERD_DB", DEFAULT_DB_URL))
    ident.set_defaults(handler=cmd_db_id, needs="controller")
