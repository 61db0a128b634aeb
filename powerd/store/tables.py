"""SQL tables (SQLAlchemy 2 typed models). Kept apart from the pydantic wire and API models.

Conventions, the same on SQLite and PostgreSQL:
- every timestamp (`ts`, `first_seen`, `last_seen`, `cleared_at`) is seconds since the epoch,
  UTC, as a double — the same numbers the wire protocol and `Clock.wall()` use, so nothing
  converts time zones on the way in or out;
- a per-minute bucket (`GpuMinute.minute`) is the integer epoch second at which the minute
  starts;
- power in W, energy in J; JSON columns hold small documents (per-row use, event data).

The schema changes only through Alembic migrations (migrations/versions/); a test checks
that these models and the migrated database agree.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Double,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Deterministic constraint names, so later migrations can refer to them on both backends.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite autoincrements only an INTEGER PRIMARY KEY; PostgreSQL gets 64-bit ids.
Id = BigInteger().with_variant(Integer(), "sqlite")

NAME_LEN = 128


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {  # noqa: RUF012 - SQLAlchemy reads this class attribute
        float: Double(),
        dict[str, Any]: JSON(),
    }


class Node(Base):
    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    row: Mapped[str | None] = mapped_column(String(NAME_LEN))
    rack: Mapped[str | None] = mapped_column(String(NAME_LEN))
    first_seen: Mapped[float]
    last_seen: Mapped[float]
    state: Mapped[str] = mapped_column(String(32))


class Gpu(Base):
    __tablename__ = "gpus"

    uuid: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    # No foreign keys from here or from the history tables: history outlives the inventory,
    # and a batched write must never fail because rows arrived in another order.
    node: Mapped[str] = mapped_column(String(NAME_LEN), index=True)
    index: Mapped[int]
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    min_cap_w: Mapped[float]
    max_cap_w: Mapped[float]


class Tick(Base):
    """Facility aggregates of one controller tick. The attributes are TickRecord's fields;
    some are stored under other column names (docs/storage.md)."""

    __tablename__ = "ticks"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    # Tick numbers restart with the controller, so they are not a key.
    tick: Mapped[int] = mapped_column(BigInteger)
    ts: Mapped[float] = mapped_column(index=True)
    budget_w: Mapped[float]
    committed_w: Mapped[float]
    draw_w: Mapped[float] = mapped_column("measured_w")  # measured GPU draw + overhead
    throughput: Mapped[float]
    solve_ms: Mapped[float]
    status: Mapped[str] = mapped_column(String(32))
    solver: Mapped[str] = mapped_column(String(32))
    gpus: Mapped[int] = mapped_column("n_gpus")
    gpus_stale: Mapped[int] = mapped_column("n_stale")
    # per row: {"budget_w", "load_w" (committed: Σ caps + overhead), "draw_w"}; None: not finite
    rows: Mapped[dict[str, Any]]


class CapChange(Base):
    """A GPU's cap as sent, stored only when it differs from the last stored one."""

    __tablename__ = "cap_changes"
    __table_args__ = (Index(None, "gpu_uuid", "ts"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(index=True)
    tick: Mapped[int] = mapped_column(BigInteger)
    gpu_uuid: Mapped[str] = mapped_column(String(NAME_LEN))
    node: Mapped[str] = mapped_column(String(NAME_LEN))
    old_w: Mapped[float | None]  # None: no earlier cap known to the writer
    new_w: Mapped[float]


class CapReason(Base):
    """Why a GPU's cap was what it was (powerd/controller/why.py), stored with each row of
    `cap_changes`: the explanation in force from `ts` until the GPU's next row. The main
    numbers in columns, the rest in `more` (powerd/store/reasons.py)."""

    __tablename__ = "cap_reasons"
    __table_args__ = (Index(None, "gpu_uuid", "ts"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(index=True)
    tick: Mapped[int] = mapped_column(BigInteger)
    gpu_uuid: Mapped[str] = mapped_column(String(NAME_LEN))
    node: Mapped[str] = mapped_column(String(NAME_LEN))
    decided_by: Mapped[str] = mapped_column(String(128))  # reason codes, comma-separated
    sent_w: Mapped[float | None]
    target_w: Mapped[float | None]
    committed_w: Mapped[float | None]
    budget_group: Mapped[str] = mapped_column(String(NAME_LEN))  # the tightest on its path
    budget_w: Mapped[float | None]
    limit_w: Mapped[float | None]
    group_committed_w: Mapped[float | None]
    price_per_kw: Mapped[float | None]
    demand_w: Mapped[float | None]
    power_w: Mapped[float | None]
    reported_cap_w: Mapped[float | None]
    sample_age_s: Mapped[float | None]
    sample_seq: Mapped[int | None] = mapped_column(BigInteger)
    lo_w: Mapped[float | None]
    hi_w: Mapped[float | None]
    more: Mapped[dict[str, Any]]


class Event(Base):
    """Events and alarms; an alarm stays active until `cleared_at` is set."""

    __tablename__ = "events"
    __table_args__ = (
        CheckConstraint("severity IN ('info', 'warning', 'alarm')", name="severity"),
        Index(None, "kind", "cleared_at"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(index=True)
    kind: Mapped[str] = mapped_column(String(64))
    severity: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]]
    cleared_at: Mapped[float | None]


class PolicyVersion(Base):
    __tablename__ = "policy_versions"
    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    ts: Mapped[float]
    sha256: Mapped[str] = mapped_column(String(64))
    source: Mapped[str] = mapped_column(String(1024))  # file path, or "api"
    yaml_text: Mapped[str] = mapped_column(Text)
    author: Mapped[str] = mapped_column(String(NAME_LEN))
    reason: Mapped[str] = mapped_column(Text)
    active: Mapped[bool] = mapped_column(Boolean)


# At most one active policy version, enforced by the database itself (a partial unique index
# works the same on SQLite and PostgreSQL).
Index(
    "uq_policy_versions_one_active",
    PolicyVersion.active,
    unique=True,
    sqlite_where=text("active"),
    postgresql_where=text("active"),
)


class AuditEntry(Base):
    """One admin action: who did what to what, when, why, and how it ended."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(index=True)
    actor: Mapped[str] = mapped_column(String(NAME_LEN))
    role: Mapped[str] = mapped_column(String(32))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(256))
    reason: Mapped[str] = mapped_column(Text)
    payload: Mapped[dict[str, Any]]
    result: Mapped[str] = mapped_column(String(256))
    # Set by the controller: a row queued while the database was down may be sent again after
    # a restart; the key makes the second insert a no-op. None: written directly.
    key: Mapped[str | None] = mapped_column(String(64), unique=True, index=True)


class OperatorState(Base):
    """Operators' changes in force (temporary budgets, pins, drains, class assignments, a
    policy replaced through the API), one row per revision; the controller's state file
    holds the same document, and a start takes the higher revision of the two."""

    __tablename__ = "operator_state"

    revision: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    ts: Mapped[float]
    state: Mapped[dict[str, Any]]


class LeaderLease(Base):
    """Who leads a scope, under which epoch, until when (seconds on the database's clock):
    powerd/store/leases.py takes, renews and gives it up."""

    __tablename__ = "leader_lease"

    scope: Mapped[str] = mapped_column(String(128), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    epoch: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[float]
    acquired_at: Mapped[float]


class ControllerMember(Base):
    """Every controller of a scope, leader or standby, as it last said (seen_at: seconds on
    the database's clock): who stands by, for status and the API."""

    __tablename__ = "controller_member"

    scope: Mapped[str] = mapped_column(String(128), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    epoch: Mapped[int] = mapped_column(BigInteger)
    seen_at: Mapped[float]
    # The domains a leader hands its nodes to, comma-separated (None: none): an overlapping
    # scope may lead beside it only then (migration 0007).
    handing_to: Mapped[str | None] = mapped_column(String(1024))


class StoreIdentity(Base):
    """The store's id, made once when the database is created (migration 0006): commands
    name their store with it, so that agents tell two databases apart (docs/safety.md,
    "Authority"). One row."""

    __tablename__ = "store_identity"
    __table_args__ = (CheckConstraint("id = 1", name="one_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    store_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float]


class GpuMinute(Base):
    """One GPU over one minute: raw samples are aggregated in memory and never stored."""

    __tablename__ = "gpu_minutes"

    # (uuid, minute) is the key a GPU's history query walks; `minute` alone serves pruning.
    uuid: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    minute: Mapped[int] = mapped_column(BigInteger, primary_key=True, index=True)
    mean_power_w: Mapped[float]
    max_power_w: Mapped[float]
    energy_j: Mapped[float]
    mean_cap_w: Mapped[float]
    samples: Mapped[int]
    # The workload's reported throughput (`perf`, a rate: tokens/s, samples/s), mean over
    # the minute's samples that carried one; None and 0: none reported (migration 0008).
    mean_perf: Mapped[float | None]
    perf_samples: Mapped[int] = mapped_column(Integer, server_default=text("0"))


class GroupMinute(Base):
    """One budget group (facility, row, or a rack or node with a budget) over one minute:
    its budget, committed caps and measured draw as the ticks saw them (migration 0008;
    `powerd pilot report` reads them)."""

    __tablename__ = "group_minutes"

    group: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    minute: Mapped[int] = mapped_column(BigInteger, primary_key=True, index=True)
    level: Mapped[int]  # 0 facility, 1 row, 2 rack, 3 node
    budget_w: Mapped[float | None]  # the lowest in force over the minute; None: no budget
    limit_w: Mapped[float | None]  # the highest committed caps could reach (an overload)
    mean_committed_w: Mapped[float]
    max_committed_w: Mapped[float]
    mean_draw_w: Mapped[float]
    max_draw_w: Mapped[float]
    over_s: Mapped[float]  # seconds the measured draw was above the budget
    ticks: Mapped[int]


class BudgetExcursion(Base):
    """A run of ticks whose measured draw was above a group's budget: from the first tick
    over to the first tick back within it (migration 0008)."""

    __tablename__ = "budget_excursions"
    __table_args__ = (Index(None, "group", "start_ts"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    group: Mapped[str] = mapped_column(String(NAME_LEN))
    level: Mapped[int]
    start_ts: Mapped[float] = mapped_column(index=True)
    end_ts: Mapped[float]
    peak_draw_w: Mapped[float]
    peak_excess_w: Mapped[float]  # the largest draw − budget over the run
    budget_w: Mapped[float]  # at the peak
