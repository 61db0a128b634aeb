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
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from powerd.store.models import LeaderLease

_T: sa.Table = LeaderLease.__table__  # type: ignore[assignment]


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

    def acquire(self, scope: str, holder: str, lease_s: float) -> Lease | None:
        """Take or renew `scope` for `holder` until the database's now + `lease_s`.

        The holder renews its own lease (same epoch), or takes one that has lapsed (epoch
        + 1; the same holder taking back its own lapsed lease keeps its epoch: nobody led in
        between). None: another holder's lease is still running.
        """
        if not lease_s > 0:
            raise ValueError("lease_s must be positive")
        mine = _T.c.holder == holder
        take = (
            sa.update(_T)
            .where(_T.c.scope == scope, sa.or_(mine, _T.c.expires_at <= self._now))
            .values(
                holder=holder,
                epoch=sa.case((mine, _T.c.epoch), else_=_T.c.epoch + 1),
                expires_at=self._now + lease_s,
                acquired_at=sa.case((mine, _T.c.acquired_at), else_=self._now),
            )
            .returning(_T.c.epoch, _T.c.expires_at, _T.c.acquired_at, self._now)
        )
        with self.engine.begin() as conn:
            row = conn.execute(take).first()
        if row is not None:
            return Lease(scope, holder, *_floats(row))
        return self._first(scope, holder, lease_s)

    def _first(self, scope: str, holder: str, lease_s: float) -> Lease | None:
        """The first lease of a scope never led (epoch 1); None if someone holds it."""
        first = (
            sa.insert(_T)
            .values(
                scope=scope,
                holder=holder,
                epoch=1,
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
