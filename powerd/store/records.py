"""Plain records handed to the store: cheap to build on the tick path, free of the ORM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Generic, TypeVar

from powerd.alarms import Severity
from powerd.controller.report import TickSummary

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class NodeRecord:
    name: str
    row: str | None
    rack: str | None
    state: str
    seen_ts: float  # sets last_seen, and first_seen the first time the node is stored


@dataclass(frozen=True, slots=True)
class GpuRecord:
    uuid: str
    node: str
    index: int
    name: str
    min_cap_w: float
    max_cap_w: float


@dataclass(frozen=True, slots=True)
class TickRecord(TickSummary):
    """A tick as stored (`ticks`): its summary, and each row's use. The fields are the
    `Tick` model's attributes; docs/storage.md lists those stored under other column names."""

    rows: dict[str, Any] = field(default_factory=dict)  # per row id: its use this tick

    @classmethod
    def from_summary(cls, summary: TickSummary, rows: dict[str, Any]) -> TickRecord:
        return cls(**{f.name: getattr(summary, f.name) for f in fields(TickSummary)}, rows=rows)


@dataclass(frozen=True, slots=True)
class EventRecord:
    ts: float
    kind: str
    severity: Severity
    message: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StoreHealth:
    connected: bool  # the last database round trip succeeded
    last_error: str | None  # the last failure, kept until a write succeeds again
    backlog: int  # records and rows waiting to be written
    dropped: int  # records and rows given up because the backlog was full
    last_flush_ts: float | None  # wall time of the last successful write


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    items: Sequence[T]
    total: int
    limit: int
    offset: int
