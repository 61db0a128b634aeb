"""Persistence: SQL tables, migrations, the non-blocking writer and the reads the API uses.

SQLite file by default, PostgreSQL in production, same code (see docs/storage.md).
"""

from powerd.alarms import Severity
from powerd.store.db import DEFAULT_URL, current_revision, head_revision, make_engine, upgrade
from powerd.store.records import (
    EventRecord,
    GpuRecord,
    NodeRecord,
    Page,
    StoreHealth,
    TickRecord,
)
from powerd.store.store import Pruned, Store
from powerd.store.writer import Retention, StoreWriter, WriterLimits

__all__ = [
    "DEFAULT_URL",
    "EventRecord",
    "GpuRecord",
    "NodeRecord",
    "Page",
    "Pruned",
    "Retention",
    "Severity",
    "Store",
    "StoreHealth",
    "StoreWriter",
    "TickRecord",
    "WriterLimits",
    "current_revision",
    "head_revision",
    "make_engine",
    "upgrade",
]
