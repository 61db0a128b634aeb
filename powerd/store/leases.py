"""Leader leases in the store's database: one leader per scope, and an epoch that grows at
every change of leader (the fencing token commands carry, docs/protocol.md).

Only the database's clock decides when a lease has lapsed: every statement reads its own
`now` (PostgreSQL's `clock_timestamp()`, SQLite's `julianday('now')`), so the controllers'
clocks never meet. Taking a lease is one conditional UPDATE (or, for a scope never led, one
INSERT that a primary key keeps single): two controllers racing for it cannot both win,
whatever the engine's isolation level.

A holder must stop acting as leader before the lease could lapse on the database's clock:
it measures `lease_s` from a moment of its own taken *before* it sent the statement that
took or renewed the lease (docs/safety.md has the timing argument). Calls block: run them
in a worker thread, never on an event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from powerd.store.tables import ControllerMember, LeaderLease, StoreIdentity
from powerd.wire import MAX_EPOCH

_T: sa.Table = LeaderLease.__table__  # type: ignore[assignment]
_M: sa.Table = ControllerMember.__table__  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class Lease:
    """A scope's lease as the database holds it; times on the database's clock, in s."""

    scope: str
    holder: str
    epoch: int
    expires_at: float
    acquired_at: float
    db_now: float  # when the statement that read or wrote it ran

    @property
    def lapsed(self) -> bool:
        return self.expires_at <= self.db_now


def _floats(row: Sequence[Any]) -> tuple[int, float, float, float]:
    """(epoch, expires_at, acquired_at, db_now) as read: the engines return Decimal or int."""
    epoch, expires_at, acquired_at, now = row
    return int(epoch), float(expires_at), float(acquired_at), float(now)


def _db_now(engine: Engine) -> sa.ColumnElement[float]:
    """The database's wall clock in Unix seconds, read when the statement runs."""
    if engine.dialect.name == "postgresql":
        return sa.cast(sa.func.extract("epoch", sa.func.clock_timestamp()), sa.Double)
    # SQLite: julianday('now') has millisecond resolution; 2440587.5 is the Unix epoch.
    return (sa.func.julianday("now") - 2440587.5) * 86400.0


class Leases:
    """Take, renew, give up and read leader leases (blocking calls: use a worker thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._now = _db_now(engine)

    def acquire(self, scope: str, holder: str, lease_s: float, *, above: int = 0) -> Lease | None:
        """Take or renew `scope` for `holder` until the database's now + `lease_s`.

        The holder renews its own lease (same epoch), or takes one that has lapsed (epoch
        + 1; the same holder taking back its own lapsed lease keeps its epoch: nobody led in
        between). None: another holder's lease is still running.

        `above`: an epoch the agents have seen that the database may not know (it was
        recreated, or restored from a backup): the lease's epoch becomes at least one more.
        """
        if not lease_s > 0:
            raise ValueError("lease_s must be positive")
        if not 0 <= above < MAX_EPOCH:
            raise ValueError(f"above must be in [0, {MAX_EPOCH})")
        mine = _T.c.holder == holder
        epoch = sa.case((mine, _T.c.epoch), else_=_T.c.epoch + 1)
        take = (
            sa.update(_T)
            .where(_T.c.scope == scope, sa.or_(mine, _T.c.expires_at <= self._now))
            .values(
                holder=holder,
                epoch=sa.case((epoch > above, epoch), else_=above + 1),
                expires_at=self._now + lease_s,
                acquired_at=sa.case((mine, _T.c.acquired_at), else_=self._now),
            )
            .returning(_T.c.epoch, _T.c.expires_at, _T.c.acquired_at, self._now)
        )
        with self.engine.begin() as conn:
            row = conn.execute(take).first()
        if row is not None:
            return Lease(scope, holder, *_floats(row))
        return self._first(scope, holder, lease_s, above + 1)

    def _first(self, scope: str, holder: str, lease_s: float, epoch: int) -> Lease | None:
        """The first lease of a scope never led; None if someone holds it."""
        first = (
            sa.insert(_T)
            .values(
                scope=scope,
                holder=holder,
                epoch=epoch,
                expires_at=self._now + lease_s,
                acquired_at=self._now,
            )
            .returning(_T.c.epoch, _T.c.expires_at, _T.c.acquired_at, self._now)
        )
        try:
            with self.engine.begin() as conn:
                row = conn.execute(first).one()
        except IntegrityError:
            return None  # the scope has a leader whose lease runs (or won the race)
        return Lease(scope, holder, *_floats(row))

    def release(self, scope: str, holder: str) -> bool:
        """Give the lease up now, so a standby need not wait for it to lapse (a clean stop).
        False: `holder` did not hold it."""
        with self.engine.begin() as conn:
            done = conn.execute(
                sa.update(_T)
                .where(_T.c.scope == scope, _T.c.holder == holder)
                .values(expires_at=self._now)
            )
            return done.rowcount == 1

    def current(self, scope: str) -> Lease | None:
        """The scope's lease as it stands (lapsed or not); None if never led."""
        with self.engine.begin() as conn:
            row = conn.execute(
                sa.select(
                    _T.c.holder, _T.c.epoch, _T.c.expires_at, _T.c.acquired_at, self._now
                ).where(_T.c.scope == scope)
            ).first()
        if row is None:
            return None
        return Lease(scope, row[0], *_floats(row[1:]))

    def store_id(self) -> str | None:
        """The store's id (migration 0006); None before its migrations have run."""
        return read_store_id(self.engine)

    def db_time(self) -> float:
        """The database's wall clock now, in Unix seconds: what a controller's own clock is
        checked against before it may take or renew a lease (docs/safety.md, "Time")."""
        with self.engine.begin() as conn:
            return float(conn.execute(sa.select(self._now)).scalar_one())

    # -- who is there: every controller of a scope says so at each attempt ----------------

    def heartbeat(
        self, scope: str, holder: str, role: str, epoch: int, handing_to: str | None = None
    ) -> None:
        """Note that `holder` runs for `scope` now, as `role` ("leader" or "standby"), and
        the domains it hands its nodes to (comma-separated; None: none)."""
        values = {
            "scope": scope,
            "holder": holder,
            "role": role,
            "epoch": epoch,
            "seen_at": self._now,
            "handing_to": handing_to,
        }
        insert = (
            sqlite_insert(_M) if self.engine.dialect.name == "sqlite" else pg_insert(_M)
        ).values(**values)
        upsert = insert.on_conflict_do_update(
            index_elements=[_M.c.scope, _M.c.holder],
            set_={"role": role, "epoch": epoch, "seen_at": self._now, "handing_to": handing_to},
        )
        with self.engine.begin() as conn:
            conn.execute(upsert)

    def overlapping(self, scopes: Sequence[str]) -> list[Overlap]:
        """The running leases of `scopes` (not lapsed by the database's clock), with the
        domains their holders say they hand over to: the scope registry's question."""
        wanted = set(scopes)
        if not wanted:
            return []
        # The running leases are few (one a scope that leads); the domains that overlap
        # ours may be thousands (every rack of a hall): filter here, not in an IN list.
        member = sa.and_(_M.c.scope == _T.c.scope, _M.c.holder == _T.c.holder)
        with self.engine.begin() as conn:
            rows = conn.execute(
                sa.select(_T.c.scope, _T.c.holder, _T.c.acquired_at, _M.c.handing_to)
                .select_from(_T.outerjoin(_M, member))
                .where(_T.c.expires_at > self._now)
            ).all()
        return [
            Overlap(str(s), str(h), float(a), tuple(filter(None, (t or "").split(","))))
            for s, h, a, t in rows
            if s in wanted
        ]

    def members(self, scope: str, within_s: float) -> list[Member]:
        """The controllers of `scope` heard from in the last `within_s` seconds (by the
        database's clock), leader first, then by name."""
        with self.engine.begin() as conn:
            rows = conn.execute(
                sa.select(_M.c.holder, _M.c.role, _M.c.epoch, self._now - _M.c.seen_at).where(
                    _M.c.scope == scope, _M.c.seen_at >= self._now - within_s
                )
            ).all()
        out = [Member(str(h), str(r), int(e), max(0.0, float(age))) for h, r, e, age in rows]
        return sorted(out, key=lambda m: (m.role != "leader", m.holder))

    def forget(self, scope: str, holder: str) -> None:
        """A controller that stops cleanly leaves the list at once."""
        with self.engine.begin() as conn:
            conn.execute(sa.delete(_M).where(_M.c.scope == scope, _M.c.holder == holder))


def read_store_id(engine: Engine) -> str | None:
    """The id a database got when it was created (migration 0006): the store's name in every
    command (docs/safety.md, "Authority"). None before its migrations have run."""
    table: sa.Table = StoreIdentity.__table__  # type: ignore[assignment]
    with engine.begin() as conn:
        if not sa.inspect(conn).has_table(table.name):
            return None
        value = conn.execute(sa.select(table.c.store_id).where(table.c.id == 1)).scalar()
    return None if value is None else str(value)


@dataclass(frozen=True, slots=True)
class Overlap:
    """A running lease of a scope that overlaps ours, and whom its holder hands over to."""

    scope: str
    holder: str
    acquired_at: float  # on the database's clock
    handing_to: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Member:
    """A controller of a scope as it last said: its role, epoch, and how long ago (s)."""

    holder: str
    role: str
    epoch: int
    age_s: float
