"""The store: reads for the admin API, durable writes for admin actions, batched writes for
the `StoreWriter`, and retention.

Reads return ORM rows detached from their session (plain attribute access, no lazy loads:
the tables have no relationships). The admin API turns them into its own pydantic models.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
from sqlalchemy import (
    Connection,
    Engine,
    Insert,
    Select,
    case,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from powerd.alarms import Severity
from powerd.store.db import DEFAULT_URL, make_engine
from powerd.store.leases import read_store_id
from powerd.store.records import EventRecord, Page
from powerd.store.tables import (
    AuditEntry,
    Base,
    BudgetExcursion,
    CapChange,
    CapReason,
    Event,
    Gpu,
    GpuMinute,
    GroupMinute,
    Node,
    OperatorState,
    PolicyVersion,
    Tick,
)


@dataclass(frozen=True, slots=True)
class PolicyHead:
    """A stored policy version's number, hash and origin, without its text."""

    version: int
    sha256: str
    source: str
    author: str


log = structlog.get_logger(__name__)

M = TypeVar("M", bound=Base)

DAY_S = 86_400.0
# Two admins saving a policy at once both pick max+1; the loser retries with the next number.
POLICY_VERSION_RETRIES = 3
# Revisions of the operators' state kept in `operator_state`: a few behind the latest, for
# a person looking at what changed just now; the audit log keeps every change.
KEEP_OPERATOR_STATES = 16


@dataclass
class Batch:
    """Rows for one write transaction, as dicts keyed by column name."""

    nodes: list[dict[str, Any]] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)
    ticks: list[dict[str, Any]] = field(default_factory=list)
    caps: list[dict[str, Any]] = field(default_factory=list)
    reasons: list[dict[str, Any]] = field(default_factory=list)  # cap_reasons
    events: list[dict[str, Any]] = field(default_factory=list)
    clears: list[tuple[str, float]] = field(default_factory=list)  # (kind, cleared_at)
    minutes: list[dict[str, Any]] = field(default_factory=list)
    group_minutes: list[dict[str, Any]] = field(default_factory=list)
    excursions: list[dict[str, Any]] = field(default_factory=list)  # budget_excursions

    def __len__(self) -> int:
        return (
            len(self.nodes)
            + len(self.gpus)
            + len(self.ticks)
            + len(self.caps)
            + len(self.reasons)
            + len(self.events)
            + len(self.clears)
            + len(self.minutes)
            + len(self.group_minutes)
            + len(self.excursions)
        )


@dataclass(frozen=True, slots=True)
class Pruned:
    minutes: int
    ticks: int
    cap_changes: int
    cap_reasons: int = 0
    group_minutes: int = 0
    excursions: int = 0


class Store:
    def __init__(
        self, url_or_engine: str | URL | Engine = DEFAULT_URL, *, read_only: bool = False
    ) -> None:
        """`read_only`: a store whose database refuses every write (a shadow controller's
        view of a database another controller steers by); only with a URL."""
        if isinstance(url_or_engine, Engine):
            if read_only:
                raise ValueError("a read-only store is made from a URL, not an engine")
            self.engine = url_or_engine
        else:
            self.engine = make_engine(url_or_engine, read_only=read_only)
        self.read_only = read_only
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def close(self) -> None:
        self.engine.dispose()

    def ping(self) -> None:
        """Raise if the database cannot be reached."""
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    # ---- batched writes (the StoreWriter's thread) ----

    def write_batch(self, batch: Batch) -> None:
        """Write everything in `batch` in one transaction, or nothing."""
        with self.engine.begin() as conn:
            if batch.nodes:
                stmt = _upsert_stmt(conn, Node)
                conn.execute(
                    stmt.on_conflict_do_update(  # type: ignore[attr-defined]
                        index_elements=["name"],
                        set_={
                            c: stmt.excluded[c]  # type: ignore[attr-defined]
                            for c in ("row", "rack", "state", "last_seen")
                        },
                    ),
                    batch.nodes,
                )
            if batch.gpus:
                stmt = _upsert_stmt(conn, Gpu)
                conn.execute(
                    stmt.on_conflict_do_update(  # type: ignore[attr-defined]
                        index_elements=["uuid"],
                        set_={
                            c: stmt.excluded[c]  # type: ignore[attr-defined]
                            for c in ("node", "index", "name", "min_cap_w", "max_cap_w")
                        },
                    ),
                    batch.gpus,
                )
            if batch.ticks:
                conn.execute(insert(Tick), batch.ticks)
            if batch.caps:
                conn.execute(insert(CapChange), batch.caps)
            if batch.reasons:
                conn.execute(insert(CapReason), batch.reasons)
            if batch.events:
                conn.execute(insert(Event), batch.events)
            for kind, cleared_at in batch.clears:
                _clear(conn, kind, cleared_at)
            if batch.minutes:
                _upsert_minutes(conn, batch.minutes)
            if batch.group_minutes:
                _upsert_group_minutes(conn, batch.group_minutes)
            if batch.excursions:
                conn.execute(insert(BudgetExcursion), batch.excursions)

    # ---- durable writes (admin actions: written before the API answers) ----

    def record_audit(
        self,
        *,
        actor: str,
        role: str,
        action: str,
        target: str,
        reason: str,
        payload: Mapping[str, Any] | None = None,
        result: str = "ok",
        ts: float | None = None,
    ) -> int:
        """Append one admin action to the audit log; returns its id."""
        entry = AuditEntry(
            ts=time.time() if ts is None else ts,
            actor=actor,
            role=role,
            action=action,
            target=target,
            reason=reason,
            payload=dict(payload or {}),
            result=result,
        )
        with self._sessions.begin() as session:
            session.add(entry)
            session.flush()
            return entry.id

    def record_policy_version(
        self,
        yaml_text: str,
        *,
        source: str,
        author: str,
        reason: str,
        activate: bool = True,
        ts: float | None = None,
        unless_active: bool = False,
    ) -> int | None:
        """Store a policy's text as the next version (active by default); return its number.

        Saving the text that is already active (a SIGHUP reload of an unchanged file)
        returns the active version instead of adding an identical one. `unless_active` (a
        controller's start-up under a lease): an active version of another text stays the
        policy of record, nothing is stored, and the answer is None.
        """
        sha = hashlib.sha256(yaml_text.encode()).hexdigest()
        for attempt in range(POLICY_VERSION_RETRIES):
            try:
                with self._sessions.begin() as session:
                    active = session.scalar(select(PolicyVersion).where(PolicyVersion.active))
                    if activate and active is not None and active.sha256 == sha:
                        return active.version
                    if unless_active and active is not None:
                        return None
                    number = (session.scalar(select(func.max(PolicyVersion.version))) or 0) + 1
                    if activate and active is not None:
                        active.active = False
                        session.flush()  # the one-active index is checked per statement
                    session.add(
                        PolicyVersion(
                            version=number,
                            ts=time.time() if ts is None else ts,
                            sha256=sha,
                            source=source,
                            yaml_text=yaml_text,
                            author=author,
                            reason=reason,
                            active=activate,
                        )
                    )
                return number
            except IntegrityError:
                if attempt == POLICY_VERSION_RETRIES - 1:
                    raise
                log.info("policy_version_conflict", attempt=attempt)
        raise AssertionError("unreachable")

    def record_audit_rows(self, rows: Sequence[Mapping[str, Any]]) -> int:
        """Append audit rows that carry a `key` (AuditEntry's columns, `id` aside), skipping
        keys already stored: the controller re-sends what it queued during an outage, and
        a restart may send a row again. Returns how many were new."""
        if not rows:
            return 0
        keys = [r["key"] for r in rows]
        with self.engine.begin() as conn:
            known = set(conn.scalars(select(AuditEntry.key).where(AuditEntry.key.in_(keys))))
            new = [dict(r) for r in rows if r["key"] not in known]
            if new:
                conn.execute(insert(AuditEntry), new)
        return len(new)

    def save_operator_state(self, revision: int, ts: float, state: Mapping[str, Any]) -> bool:
        """Store one revision of the operators' state, and keep only the last
        KEEP_OPERATOR_STATES; False if that revision is stored already (a re-send, or
        another controller wrote it)."""
        with self.engine.begin() as conn:
            stmt = _upsert_stmt(conn, OperatorState).on_conflict_do_nothing(  # type: ignore[attr-defined]
                index_elements=["revision"]
            )
            result = conn.execute(stmt, {"revision": revision, "ts": ts, "state": dict(state)})
            if result.rowcount:
                # Only the latest revision is ever read (a start, a standby following); the
                # audit log is the record of changes. Each row holds every job's uuids.
                newest = conn.scalar(select(func.max(OperatorState.revision))) or revision
                conn.execute(
                    delete(OperatorState).where(
                        OperatorState.revision <= newest - KEEP_OPERATOR_STATES
                    )
                )
            return bool(result.rowcount)

    def store_id(self) -> str | None:
        """The id this database got when it was created (migration 0006): the store's name
        in every command (docs/safety.md, "Authority"). None before its migrations."""
        return read_store_id(self.engine)

    def latest_operator_state(self) -> OperatorState | None:
        """The highest revision of the operators' state; None before the first."""
        return self._one(select(OperatorState).order_by(OperatorState.revision.desc()).limit(1))

    def clear_alarm(self, kind: str, ts: float | None = None) -> int:
        """Clear every active event of `kind` raised at or before `ts`; returns how many."""
        with self.engine.begin() as conn:
            return _clear(conn, kind, time.time() if ts is None else ts)

    # ---- reads ----

    def nodes(self) -> Sequence[Node]:
        return self._all(select(Node).order_by(Node.name))

    def gpus(self, node: str | None = None) -> Sequence[Gpu]:
        stmt = select(Gpu).order_by(Gpu.node, Gpu.index)
        if node is not None:
            stmt = stmt.where(Gpu.node == node)
        return self._all(stmt)

    def recent_ticks(self, limit: int = 100, since: float | None = None) -> Sequence[Tick]:
        """The latest ticks, newest first."""
        stmt = select(Tick).order_by(Tick.ts.desc(), Tick.id.desc()).limit(limit)
        if since is not None:
            stmt = stmt.where(Tick.ts >= since)
        return self._all(stmt)

    def tick_series(
        self, since: float, limit: int = 200_000
    ) -> list[tuple[float, float, float, float]]:
        """(ts, budget_w, committed_w, draw_w) of the ticks since `since`, oldest first: the
        facility's draw against its budget, for a chart (at most `limit`, the newest)."""
        stmt = (
            select(Tick.ts, Tick.budget_w, Tick.committed_w, Tick.draw_w)
            .where(Tick.ts >= since)
            .order_by(Tick.ts.desc(), Tick.id.desc())
            .limit(limit)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(stmt).all()
        return [(r[0], r[1], r[2], r[3]) for r in reversed(rows)]

    def events(
        self,
        *,
        severity: Severity | str | None = None,
        active_only: bool = False,
        kind: str | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> Page[Event]:
        """Events newest first; `active_only`: not cleared yet."""
        stmt = select(Event)
        if severity is not None:
            stmt = stmt.where(Event.severity == str(severity))
        if active_only:
            stmt = stmt.where(Event.cleared_at.is_(None))
        if kind is not None:
            stmt = stmt.where(Event.kind == kind)
        return self._page(stmt.order_by(Event.ts.desc(), Event.id.desc()), limit, offset)

    def audit_log(
        self,
        *,
        actor: str | None = None,
        action: str | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> Page[AuditEntry]:
        """Audit entries newest first."""
        stmt = select(AuditEntry)
        if actor is not None:
            stmt = stmt.where(AuditEntry.actor == actor)
        if action is not None:
            stmt = stmt.where(AuditEntry.action == action)
        return self._page(stmt.order_by(AuditEntry.id.desc()), limit, offset)

    def policy_versions(self, *, limit: int = 100, offset: int = 0) -> Page[PolicyVersion]:
        """Policy versions newest first."""
        return self._page(
            select(PolicyVersion).order_by(PolicyVersion.version.desc()), limit, offset
        )

    def active_policy(self) -> PolicyVersion | None:
        return self._one(select(PolicyVersion).where(PolicyVersion.active))

    def active_policy_head(self) -> PolicyHead | None:
        """The active version without its text: what a controller compares every lease
        round (the text, which may be large, is read only when the version changed)."""
        with self._sessions() as session:
            row = session.execute(
                select(
                    PolicyVersion.version,
                    PolicyVersion.sha256,
                    PolicyVersion.source,
                    PolicyVersion.author,
                ).where(PolicyVersion.active)
            ).first()
        return None if row is None else PolicyHead(*row)

    def policy_version(self, version: int) -> PolicyVersion | None:
        return self._one(select(PolicyVersion).where(PolicyVersion.version == version))

    def cap_changes(
        self,
        uuid: str,
        *,
        since: float | None = None,
        until: float | None = None,
        limit: int = 1000,
    ) -> Sequence[CapChange]:
        """A GPU's cap changes, oldest first."""
        stmt = select(CapChange).where(CapChange.gpu_uuid == uuid)
        if since is not None:
            stmt = stmt.where(CapChange.ts >= since)
        if until is not None:
            stmt = stmt.where(CapChange.ts < until)
        return self._all(stmt.order_by(CapChange.ts, CapChange.id).limit(limit))

    def cap_reason_at(self, uuid: str, at: float | None = None) -> CapReason | None:
        """The explanation of a GPU's cap in force at `at` (the last stored at or before it;
        None: the latest stored), or None if none is stored."""
        stmt = select(CapReason).where(CapReason.gpu_uuid == uuid)
        if at is not None:
            stmt = stmt.where(CapReason.ts <= at)
        return self._one(stmt.order_by(CapReason.ts.desc(), CapReason.id.desc()).limit(1))

    def latest_caps(self) -> dict[str, float]:
        """The last stored cap of every GPU (a restarted controller starts from these)."""
        last_ids = select(func.max(CapChange.id)).group_by(CapChange.gpu_uuid)
        stmt = select(CapChange.gpu_uuid, CapChange.new_w).where(CapChange.id.in_(last_ids))
        with self.engine.connect() as conn:
            rows = conn.execute(stmt).all()
        return {row.gpu_uuid: row.new_w for row in rows}

    def gpu_history(
        self,
        uuid: str,
        *,
        since: float | None = None,
        until: float | None = None,
        limit: int = 24 * 60,
    ) -> Sequence[GpuMinute]:
        """A GPU's per-minute aggregates, oldest first; `since`/`until` in epoch seconds."""
        stmt = select(GpuMinute).where(GpuMinute.uuid == uuid)
        if since is not None:
            stmt = stmt.where(GpuMinute.minute >= int(since // 60 * 60))
        if until is not None:
            stmt = stmt.where(GpuMinute.minute < until)
        return self._all(stmt.order_by(GpuMinute.minute).limit(limit))

    # ---- retention ----

    def prune(
        self,
        now: float,
        *,
        keep_minutes_days: float,
        keep_ticks_days: float,
        keep_cap_changes_days: float | None = None,
    ) -> Pruned:
        """Delete per-minute rows (GPUs', groups' and the budget excursions), tick rows and
        cap changes (with their reasons) older than their retention.

        Cap changes default to the tick retention. Events, policy versions and the audit
        log are never pruned here: they are small and operators are accountable for them.
        """
        if keep_cap_changes_days is None:
            keep_cap_changes_days = keep_ticks_days
        with self.engine.begin() as conn:
            minutes = conn.execute(
                delete(GpuMinute).where(GpuMinute.minute < now - keep_minutes_days * DAY_S)
            ).rowcount
            minute_cut = now - keep_minutes_days * DAY_S
            groups = conn.execute(
                delete(GroupMinute).where(GroupMinute.minute < minute_cut)
            ).rowcount
            excursions = conn.execute(
                delete(BudgetExcursion).where(BudgetExcursion.end_ts < minute_cut)
            ).rowcount
            ticks = conn.execute(
                delete(Tick).where(Tick.ts < now - keep_ticks_days * DAY_S)
            ).rowcount
            caps = conn.execute(
                delete(CapChange).where(CapChange.ts < now - keep_cap_changes_days * DAY_S)
            ).rowcount
            reasons = conn.execute(
                delete(CapReason).where(CapReason.ts < now - keep_cap_changes_days * DAY_S)
            ).rowcount
        return Pruned(
            minutes=minutes,
            ticks=ticks,
            cap_changes=caps,
            cap_reasons=reasons,
            group_minutes=groups,
            excursions=excursions,
        )

    # ---- helpers ----

    def _all(self, stmt: Select[M]) -> Sequence[M]:
        with self._sessions() as session:
            return session.scalars(stmt).all()

    def _one(self, stmt: Select[M]) -> M | None:
        with self._sessions() as session:
            return session.scalar(stmt)

    def _page(self, stmt: Select[M], limit: int, offset: int) -> Page[M]:
        with self._sessions() as session:
            total = session.scalar(select(func.count()).select_from(stmt.order_by(None).subquery()))
            items = session.scalars(stmt.limit(limit).offset(offset)).all()
        return Page(items=items, total=total or 0, limit=limit, offset=offset)


def event_row(rec: EventRecord) -> dict[str, Any]:
    return {
        "ts": rec.ts,
        "kind": rec.kind,
        "severity": str(rec.severity),
        "message": rec.message,
        "data": rec.data,
        "cleared_at": None,
    }


def _clear(conn: Connection, kind: str, cleared_at: float) -> int:
    # Only events raised at or before the clear: a clear queued before a new alarm of the
    # same kind (both in one batch) must not clear that new alarm.
    result = conn.execute(
        update(Event)
        .where(Event.kind == kind, Event.cleared_at.is_(None), Event.ts <= cleared_at)
        .values(cleared_at=cleared_at)
    )
    return result.rowcount


def _upsert_stmt(conn: Connection, model: type[Base]) -> Insert:
    """INSERT that can take ON CONFLICT DO UPDATE, in the dialect at hand."""
    name = conn.dialect.name
    if name == "postgresql":
        return postgresql.insert(model)
    if name == "sqlite":
        return sqlite.insert(model)
    raise NotImplementedError(f"the store supports SQLite and PostgreSQL, not {name}")


def _upsert_minutes(conn: Connection, rows: Iterable[dict[str, Any]]) -> None:
    # A minute written again (a late sample, or a partial minute flushed at shutdown and
    # continued after a restart) merges into the stored row, weighting means by samples.
    stmt = _upsert_stmt(conn, GpuMinute)
    new = stmt.excluded  # type: ignore[attr-defined]
    old = GpuMinute.__table__.c
    total = old.samples + new.samples
    stmt = stmt.on_conflict_do_update(  # type: ignore[attr-defined]
        index_elements=["uuid", "minute"],
        set_={
            "mean_power_w": (old.mean_power_w * old.samples + new.mean_power_w * new.samples)
            / total,
            "max_power_w": case(
                (new.max_power_w > old.max_power_w, new.max_power_w), else_=old.max_power_w
            ),
            "energy_j": old.energy_j + new.energy_j,
            "mean_cap_w": (old.mean_cap_w * old.samples + new.mean_cap_w * new.samples) / total,
            "samples": total,
            # Weighted by the samples that reported one; NULL while none did.
            "mean_perf": (
                func.coalesce(old.mean_perf, 0.0) * old.perf_samples
                + func.coalesce(new.mean_perf, 0.0) * new.perf_samples
            )
            / func.nullif(old.perf_samples + new.perf_samples, 0),
            "perf_samples": old.perf_samples + new.perf_samples,
        },
    )
    conn.execute(stmt, list(rows))


def _upsert_group_minutes(conn: Connection, rows: Iterable[dict[str, Any]]) -> None:
    # A minute written again (a partial minute flushed at shutdown, continued after a
    # restart) merges into the stored row, means weighted by ticks.
    stmt = _upsert_stmt(conn, GroupMinute)
    new = stmt.excluded  # type: ignore[attr-defined]
    old = GroupMinute.__table__.c
    total = old.ticks + new.ticks

    def weighted(column: str) -> Any:
        return (old[column] * old.ticks + new[column] * new.ticks) / total

    def larger(column: str) -> Any:
        return case((new[column] > old[column], new[column]), else_=old[column])

    stmt = stmt.on_conflict_do_update(  # type: ignore[attr-defined]
        index_elements=["group", "minute"],
        set_={
            "budget_w": case(
                (old.budget_w.is_(None), new.budget_w),
                (new.budget_w < old.budget_w, new.budget_w),
                else_=old.budget_w,
            ),
            "limit_w": case(
                (old.limit_w.is_(None), new.limit_w),
                (new.limit_w > old.limit_w, new.limit_w),
                else_=old.limit_w,
            ),
            "mean_committed_w": weighted("mean_committed_w"),
            "max_committed_w": larger("max_committed_w"),
            "mean_draw_w": weighted("mean_draw_w"),
            "max_draw_w": larger("max_draw_w"),
            "over_s": old.over_s + new.over_s,
            "ticks": total,
        },
    )
    conn.execute(stmt, list(rows))
