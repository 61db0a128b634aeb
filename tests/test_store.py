"""The store against real databases: a SQLite file and a PostgreSQL server (tests/pg.py)."""

from __future__ import annotations

import hashlib
import math
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.exc import IntegrityError
from structlog.testing import capture_logs
from support.pg import BACKENDS, create_database, pg_database, unique_name, url_for

from powerd.clock import ManualClock
from powerd.controller.report import TickSummary
from powerd.store import (
    EventRecord,
    GpuRecord,
    NodeRecord,
    Retention,
    Severity,
    Store,
    StoreWriter,
    TickRecord,
    WriterLimits,
    current_revision,
    head_revision,
    upgrade,
)
from powerd.store.aggregate import MinuteAggregator
from powerd.store.db import make_engine, migrations_dir, normalize_url
from powerd.store.store import KEEP_OPERATOR_STATES, Batch
from powerd.store.tables import Base, PolicyVersion
from powerd.store.tables import OperatorState as OperatorStateRow

T0 = 1_700_000_040.0  # the start of a minute (divisible by 60)
assert T0 % 60 == 0


@pytest.fixture(params=BACKENDS)
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """URL of an empty database on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'powerd.db'}"
    else:
        with pg_database() as url:
            yield url


@pytest.fixture
def store(empty_url: str) -> Iterator[Store]:
    upgrade(empty_url)
    s = Store(empty_url)
    yield s
    s.close()


def writer_for(store: Store, **limits: Any) -> StoreWriter:
    # A manual clock: no backoff or prune schedule depends on real time passing.
    clock = ManualClock(start=0.0, wall_offset=T0)
    return StoreWriter(store, limits=WriterLimits(**limits), clock=clock)


# ---- migrations ----


def test_migrations_build_the_schema_of_the_models(empty_url: str) -> None:
    assert current_revision(empty_url) is None
    upgrade(empty_url)
    assert current_revision(empty_url) == head_revision()
    upgrade(empty_url)  # already at head: a no-op, not an error
    assert current_revision(empty_url) == head_revision()

    engine = make_engine(empty_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
            )
            tables = set(sa.inspect(conn).get_table_names())
    finally:
        engine.dispose()
    assert diff == []
    assert tables == {*Base.metadata.tables, "alembic_version"}


def test_urls_map_plain_postgresql_to_psycopg() -> None:
    assert normalize_url("postgresql://u@h:5432/d").drivername == "postgresql+psycopg"
    assert normalize_url("postgres://u@h/d").drivername == "postgresql+psycopg"
    assert normalize_url("postgresql+psycopg://u@h/d").drivername == "postgresql+psycopg"
    assert normalize_url("sqlite:///x.db").drivername == "sqlite"


def test_migrations_are_found_from_the_package() -> None:
    path = migrations_dir()
    assert (path / "env.py").is_file()
    assert any((path / "versions").glob("*.py"))


# ---- round trip of every table ----


def test_round_trip_of_every_table(store: Store) -> None:
    w = writer_for(store)
    w.submit_nodes([NodeRecord("n1", "row-a", "rack-1", "steered", T0)])
    w.submit_gpus(
        [
            GpuRecord("GPU-a", "n1", 0, "H100", 200.0, 700.0),
            GpuRecord("GPU-b", "n1", 1, "H100", 200.0, 700.0),
        ]
    )
    w.submit_tick(
        TickRecord(
            tick=7,
            ts=T0 + 1.5,
            budget_w=10_000.0,
            committed_w=9_000.0,
            draw_w=8_123.25,
            throughput=42.5,
            solve_ms=3.25,
            status="optimal",
            solver="fast",
            gpus=2,
            gpus_stale=1,
            rows={"row-a": {"budget_w": 5000.0, "committed_w": 4500.0}},
        )
    )
    w.submit_caps(7, T0 + 1.5, {"n1": {"GPU-a": 650.0, "GPU-b": 300.0}})
    w.submit_event(
        EventRecord(T0 + 2, "budget_cut", Severity.WARNING, "facility budget cut", {"to_w": 9e3})
    )
    w.submit_samples(["GPU-a", "GPU-b"], T0 + 3, [400.0, 250.0], [650.0, 300.0], [0.0, 0.0])
    assert w.flush(final=True)

    [node] = store.nodes()
    assert (node.name, node.row, node.rack, node.state) == ("n1", "row-a", "rack-1", "steered")
    assert node.first_seen == node.last_seen == T0
    gpus = store.gpus(node="n1")
    assert [(g.uuid, g.index, g.name, g.min_cap_w, g.max_cap_w) for g in gpus] == [
        ("GPU-a", 0, "H100", 200.0, 700.0),
        ("GPU-b", 1, "H100", 200.0, 700.0),
    ]
    [tick] = store.recent_ticks()
    assert (tick.tick, tick.ts, tick.budget_w, tick.committed_w, tick.draw_w) == (
        7,
        T0 + 1.5,
        10_000.0,
        9_000.0,
        8_123.25,
    )
    assert (tick.throughput, tick.solve_ms, tick.status, tick.solver) == (
        42.5,
        3.25,
        "optimal",
        "fast",
    )
    assert (tick.gpus, tick.gpus_stale) == (2, 1)
    assert tick.rows == {"row-a": {"budget_w": 5000.0, "committed_w": 4500.0}}
    [cap] = store.cap_changes("GPU-b")
    assert (cap.ts, cap.tick, cap.gpu_uuid, cap.node, cap.old_w, cap.new_w) == (
        T0 + 1.5,
        7,
        "GPU-b",
        "n1",
        None,
        300.0,
    )
    [event] = store.events().items
    assert (event.ts, event.kind, event.severity, event.message) == (
        T0 + 2,
        "budget_cut",
        "warning",
        "facility budget cut",
    )
    assert event.data == {"to_w": 9e3}
    assert event.cleared_at is None
    [minute] = store.gpu_history("GPU-a")
    assert (minute.uuid, minute.minute, minute.mean_power_w, minute.max_power_w) == (
        "GPU-a",
        int(T0),
        400.0,
        400.0,
    )
    assert (minute.energy_j, minute.mean_cap_w, minute.samples) == (0.0, 650.0, 1)

    audit_id = store.record_audit(
        actor="alice",
        role="operator",
        action="budget.set",
        target="facility",
        reason="grid demand response",
        payload={"budget_w": 8000, "expires_s": 3600},
        result="ok",
        ts=T0 + 5,
    )
    [entry] = store.audit_log().items
    assert entry.id == audit_id
    assert (entry.ts, entry.actor, entry.role, entry.action, entry.target) == (
        T0 + 5,
        "alice",
        "operator",
        "budget.set",
        "facility",
    )
    assert (entry.reason, entry.payload, entry.result) == (
        "grid demand response",
        {"budget_w": 8000, "expires_s": 3600},
        "ok",
    )

    version = store.record_policy_version(
        "tick_s: 1\n", source="/etc/powerd/policy.yaml", author="bob", reason="first", ts=T0
    )
    got = store.policy_version(version)
    assert got is not None
    assert (got.version, got.ts, got.source, got.yaml_text, got.author, got.reason) == (
        1,
        T0,
        "/etc/powerd/policy.yaml",
        "tick_s: 1\n",
        "bob",
        "first",
    )
    assert got.active
    assert got.sha256 == hashlib.sha256(b"tick_s: 1\n").hexdigest()


# ---- cap changes ----


def test_a_gpus_cap_is_stored_at_most_once_an_interval(store: Store) -> None:
    w = writer_for(store, cap_interval_s=60)  # the controller's default
    caps = [
        (1, 0, 500.0),  # the first cap known: stored
        (2, 1, 450.0),  # within 60 s of the last stored one: not yet
        (3, 30, 500.2),  # back where it was stored: nothing to store
        (4, 59, 420.0),
        (5, 60, 410.0),  # the interval is over and the cap differs: stored as it is now
        (6, 61, 300.0),
        (7, 125, 300.0),
        (8, 126, 300.0),  # a repeat
    ]
    for tick, t, watts in caps:
        w.submit_caps(tick, T0 + t, {"n1": {"GPU-a": watts, "GPU-b": 200.0 + tick}})
    assert w.flush()
    a = [(c.tick, c.old_w, c.new_w) for c in store.cap_changes("GPU-a")]
    assert a == [(1, None, 500.0), (5, 500.0, 410.0), (7, 410.0, 300.0)]
    b = [(c.tick, c.new_w) for c in store.cap_changes("GPU-b")]  # each GPU on its own
    assert b == [(1, 201.0), (5, 205.0), (7, 207.0)]


def test_only_cap_changes_are_stored(store: Store) -> None:
    w = writer_for(store, cap_epsilon_w=0.5, cap_interval_s=0)  # every move
    w.submit_caps(1, T0 + 1, {"n1": {"GPU-a": 500.0, "GPU-b": 300.0}})
    w.submit_caps(2, T0 + 2, {"n1": {"GPU-a": 500.0, "GPU-b": 300.0}})  # repeat
    w.submit_caps(3, T0 + 3, {"n1": {"GPU-a": 500.2, "GPU-b": 350.0}})  # noise on a
    w.submit_caps(4, T0 + 4, {"n1": {"GPU-a": 500.6, "GPU-b": 350.0}})  # drift adds up
    w.submit_caps(5, T0 + 5, {"n1": {"GPU-a": 400.0, "GPU-b": 350.0}})
    assert w.flush()

    a = [(c.tick, c.old_w, c.new_w) for c in store.cap_changes("GPU-a")]
    b = [(c.tick, c.old_w, c.new_w) for c in store.cap_changes("GPU-b")]
    assert a == [(1, None, 500.0), (4, 500.0, 500.6), (5, 500.6, 400.0)]
    assert b == [(1, None, 300.0), (3, 300.0, 350.0)]
    assert store.latest_caps() == {"GPU-a": 400.0, "GPU-b": 350.0}

    # A restarted controller seeds its writer from the store: a cap in force is no change.
    w2 = writer_for(store, cap_interval_s=0)
    w2.seed_caps(store.latest_caps())
    w2.submit_caps(6, T0 + 6, {"n1": {"GPU-a": 400.0, "GPU-b": 360.0}})
    assert w2.flush()
    assert [c.tick for c in store.cap_changes("GPU-a")] == [1, 4, 5]
    assert [(c.tick, c.old_w, c.new_w) for c in store.cap_changes("GPU-b")][-1] == (
        6,
        350.0,
        360.0,
    )


# ---- per-minute aggregation ----


def test_minute_aggregates_of_a_known_series() -> None:
    agg = MinuteAggregator(grace_s=10.0)
    # One GPU, a sample every 10 s from T0: power, committed cap, energy counter (J).
    series = [
        (T0 + 0, 100.0, 500.0, 1_000.0),  # first sample ever: no energy yet
        (T0 + 10, 300.0, 500.0, 3_000.0),  # +2000 J
        (T0 + 20, 200.0, 700.0, 5_000.0),  # +2000 J
        (T0 + 20, 999.0, 999.0, 9_999.0),  # same ts: a resubmitted sample, ignored
        (T0 + 30, 400.0, 700.0, 100.0),  # counter went down (reset): 400 W x 10 s
        (T0 + 59, 0.0, 700.0, 150.0),  # +50 J
        (T0 + 60, 100.0, 700.0, 250.0),  # next minute: +100 J there
    ]
    for ts, p, committed, e in series:
        agg.add(["GPU-a"], ts, [p], [committed], [e])
    assert agg.close() == []  # the first minute is still within its grace period

    agg.add(["GPU-a"], T0 + 70, [100.0], [700.0], [1_250.0])  # +1000 J in the second minute
    rows = agg.close()
    assert rows == [
        {
            "uuid": "GPU-a",
            "minute": int(T0),
            "mean_power_w": (100 + 300 + 200 + 400 + 0) / 5,
            "max_power_w": 400.0,
            "energy_j": 2_000 + 2_000 + 4_000 + 50,
            "mean_cap_w": (500 + 500 + 700 + 700 + 700) / 5,
            "samples": 5,
            "mean_perf": None,  # no workload reported one
            "perf_samples": 0,
        }
    ]
    [second] = agg.close(final=True)
    assert (second["minute"], second["samples"], second["energy_j"]) == (int(T0 + 60), 2, 1_100)
    assert agg.open_minutes == 0


def test_minutes_are_written_when_they_close_and_merge_when_continued(store: Store) -> None:
    uuids = ["GPU-a", "GPU-b"]
    w = writer_for(store, minute_grace_s=5.0)
    w.submit_samples(uuids, T0 + 10, [100.0, 200.0], [500.0, 500.0], [0.0, 0.0])
    w.submit_samples(uuids, [T0 + 20, T0 + 21], [300.0, 400.0], [500.0, 600.0], [2e3, 4e3])
    assert w.flush()
    assert store.gpu_history("GPU-a") == []  # the minute is still open

    # A partial minute is written at shutdown ...
    assert w.flush(final=True)
    [a] = store.gpu_history("GPU-a")
    assert (a.samples, a.mean_power_w, a.max_power_w, a.energy_j) == (2, 200.0, 300.0, 2e3)

    # ... and a restarted writer continuing the same minute merges into the stored row.
    w2 = writer_for(store, minute_grace_s=5.0)
    w2.submit_samples(uuids, T0 + 30, [600.0, 200.0], [700.0, 600.0], [5e3, 5e3])
    w2.submit_samples(uuids, T0 + 40, [200.0, 200.0], [700.0, 600.0], [7e3, 7e3])
    w2.submit_samples(uuids, T0 + 66, [200.0, 200.0], [700.0, 600.0], [9e3, 9e3])  # closes it
    assert w2.flush()
    [a] = store.gpu_history("GPU-a", since=T0, until=T0 + 60)
    assert a.samples == 4
    assert a.mean_power_w == pytest.approx((100 + 300 + 600 + 200) / 4)
    assert a.max_power_w == 600.0
    assert a.mean_cap_w == pytest.approx((500 + 500 + 700 + 700) / 4)
    # The restarted writer has no earlier counter reading, so its first sample adds none.
    assert a.energy_j == pytest.approx(2e3 + 2e3)
    [b] = store.gpu_history("GPU-b", since=T0, until=T0 + 60)
    assert (b.samples, b.max_power_w) == (4, 400.0)


# ---- retention ----


def test_prune_deletes_only_rows_past_their_retention(store: Store) -> None:
    day = 86_400.0
    now = T0 + 40 * day
    old, recent = now - 10 * day, now - 1 * day
    tick = {
        "tick": 1,
        "budget_w": 1.0,
        "committed_w": 1.0,
        "measured_w": 1.0,
        "throughput": 1.0,
        "solve_ms": 1.0,
        "status": "optimal",
        "solver": "fast",
        "n_gpus": 1,
        "n_stale": 0,
        "rows": {},
    }
    minute = {"mean_power_w": 1.0, "max_power_w": 1.0, "energy_j": 1.0, "mean_cap_w": 1.0}
    cap = {"tick": 1, "gpu_uuid": "GPU-a", "node": "n1", "old_w": None, "new_w": 1.0}
    store.write_batch(
        Batch(
            ticks=[{**tick, "ts": old}, {**tick, "ts": recent}],
            minutes=[
                {**minute, "uuid": "GPU-a", "minute": int(now - 35 * day), "samples": 1},
                {**minute, "uuid": "GPU-a", "minute": int(now - 20 * day), "samples": 1},
            ],
            caps=[{**cap, "ts": old}, {**cap, "ts": recent}],
            events=[
                {
                    "ts": old,
                    "kind": "k",
                    "severity": "info",
                    "message": "",
                    "data": {},
                    "cleared_at": None,
                }
            ],
        )
    )
    pruned = store.prune(now, keep_minutes_days=30, keep_ticks_days=7)
    assert (pruned.minutes, pruned.ticks, pruned.cap_changes) == (1, 1, 1)
    assert [t.ts for t in store.recent_ticks()] == [recent]
    assert [m.minute for m in store.gpu_history("GPU-a")] == [int(now - 20 * day)]
    assert [c.ts for c in store.cap_changes("GPU-a")] == [recent]
    assert store.events().total == 1  # events are not pruned


def test_only_the_last_operator_states_are_kept(store: Store) -> None:
    """Every revision holds every job's uuids: the table keeps the latest few, not one row
    per write for ever, and the latest is what a start or a standby reads."""
    for revision in range(1, KEEP_OPERATOR_STATES + 11):
        assert store.save_operator_state(revision, float(revision), {"revision": revision})
    store.save_operator_state(5, 5.0, {"revision": 5})  # an old one sent again: not kept
    with store.engine.connect() as conn:
        kept = sorted(conn.scalars(sa.select(OperatorStateRow.revision)))
    assert kept == list(range(11, KEEP_OPERATOR_STATES + 11))
    latest = store.latest_operator_state()
    assert latest is not None and latest.state == {"revision": KEEP_OPERATOR_STATES + 10}


def test_tick_series_is_the_window_oldest_first(store: Store) -> None:
    w = writer_for(store)
    for n, ts in enumerate([T0 - 100, T0, T0 + 1, T0 + 2]):
        w.submit_tick(_tick(n, ts=ts))
    assert w.flush()
    assert store.tick_series(T0) == [(T0 + k, 1e4, 9e3, 8e3) for k in (0, 1, 2)]
    assert store.tick_series(T0, limit=2) == [(T0 + 1, 1e4, 9e3, 8e3), (T0 + 2, 1e4, 9e3, 8e3)]
    assert store.tick_series(T0 + 10) == []


def test_writer_prunes_with_its_retention(store: Store) -> None:
    clock = ManualClock(start=0.0, wall_offset=T0 + 10 * 86_400)
    w = StoreWriter(
        store, clock=clock, retention=Retention(keep_minutes_days=30, keep_ticks_days=1)
    )
    w.submit_tick(_tick(1, ts=T0))  # 10 days old by the writer's clock
    w.submit_tick(_tick(2, ts=T0 + 10 * 86_400 - 5))
    assert w.flush()  # written, then pruned in the same cycle
    assert [t.tick for t in store.recent_ticks()] == [2]


# ---- events and alarms ----


def test_events_filter_and_clear(store: Store) -> None:
    w = writer_for(store)
    w.submit_event(EventRecord(T0 + 1, "controller_started", Severity.INFO, "up"))
    w.submit_event(EventRecord(T0 + 2, "store_unreachable", Severity.ALARM, "db down"))
    w.submit_event(EventRecord(T0 + 3, "stale_nodes", Severity.WARNING, "2 stale", {"n": 2}))
    w.submit_clear("store_unreachable", T0 + 4)
    # Raised again after the clear, in the same batch: it stays active.
    w.submit_event(EventRecord(T0 + 5, "store_unreachable", Severity.ALARM, "db down again"))
    assert w.flush()

    alarms = store.events(severity=Severity.ALARM)
    assert [(e.message, e.cleared_at) for e in alarms.items] == [
        ("db down again", None),
        ("db down", T0 + 4),
    ]
    active = store.events(active_only=True)
    assert [e.kind for e in active.items] == [
        "store_unreachable",
        "stale_nodes",
        "controller_started",
    ]
    assert active.total == 3

    assert store.clear_alarm("stale_nodes", ts=T0 + 6) == 1
    assert [e.kind for e in store.events(severity="warning", active_only=True).items] == []
    page = store.events(limit=2, offset=2)
    assert (page.total, [e.ts for e in page.items]) == (4, [T0 + 2, T0 + 1])


# ---- audit log and policy versions ----


def test_audit_log_pages_newest_first(store: Store) -> None:
    for i in range(5):
        store.record_audit(
            actor="alice" if i % 2 == 0 else "bob",
            role="operator",
            action="pin.set",
            target=f"GPU-{i}",
            reason=f"reason {i}",
            ts=T0 + i,
        )
    first = store.audit_log(limit=2)
    second = store.audit_log(limit=2, offset=2)
    last = store.audit_log(limit=2, offset=4)
    assert first.total == second.total == last.total == 5
    assert [e.target for e in [*first.items, *second.items, *last.items]] == [
        "GPU-4",
        "GPU-3",
        "GPU-2",
        "GPU-1",
        "GPU-0",
    ]
    alice = store.audit_log(actor="alice")
    assert (alice.total, [e.target for e in alice.items]) == (3, ["GPU-4", "GPU-2", "GPU-0"])


def test_policy_versions(store: Store) -> None:
    assert store.active_policy() is None
    v1 = store.record_policy_version("a: 1\n", source="policy.yaml", author="ops", reason="boot")
    v2 = store.record_policy_version("a: 2\n", source="api", author="alice", reason="raise")
    assert (v1, v2) == (1, 2)
    active = store.active_policy()
    assert active is not None
    assert (active.version, active.yaml_text) == (2, "a: 2\n")

    # Reloading the active text (SIGHUP on an unchanged file) is not a new version.
    assert store.record_policy_version("a: 2\n", source="api", author="x", reason="again") == 2
    # A candidate recorded without activating leaves the active one alone.
    v3 = store.record_policy_version(
        "a: 3\n", source="api", author="x", reason="draft", activate=False
    )
    assert v3 == 3
    still = store.active_policy()
    assert still is not None and still.version == 2
    # Going back to an older text makes a new version with that text.
    assert store.record_policy_version("a: 1\n", source="api", author="x", reason="rollback") == 4

    listed = store.policy_versions()
    assert [(p.version, p.active) for p in listed.items] == [
        (4, True),
        (3, False),
        (2, False),
        (1, False),
    ]
    got = store.policy_version(1)
    assert got is not None and got.yaml_text == "a: 1\n"
    assert store.policy_version(99) is None


def test_the_database_allows_one_active_policy(store: Store) -> None:
    store.record_policy_version("a: 1\n", source="api", author="x", reason="r")
    with pytest.raises(IntegrityError), store.engine.begin() as conn:
        conn.execute(
            sa.insert(PolicyVersion).values(
                version=2,
                ts=T0,
                sha256="0" * 64,
                source="api",
                yaml_text="a: 2\n",
                author="x",
                reason="r",
                active=True,
            )
        )


def test_a_tick_record_is_the_tick_summary_and_its_rows() -> None:
    s = TickSummary(3, T0, "optimal", "fast", 2.0, math.inf, 9e3, 8e3, 1.5, 4, 1)
    rows = {"row-a": {"budget_w": None, "load_w": 4500.0, "draw_w": 4000.0}}
    assert asdict(TickRecord.from_summary(s, rows)) == asdict(s) | {"rows": rows}


# ---- the writer never blocks the tick ----


def _tick(n: int, ts: float = T0) -> TickRecord:
    return TickRecord(
        tick=n,
        ts=ts,
        status="optimal",
        solver="fast",
        solve_ms=1.0,
        budget_w=1e4,
        committed_w=9e3,
        draw_w=8e3,
        throughput=1.0,
        gpus=1,
        gpus_stale=0,
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(params=BACKENDS)
def unreachable(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, Callable[[], None]]]:
    """A database URL that cannot be opened yet, and a function that makes it usable."""
    if request.param == "sqlite":
        missing_dir = tmp_path / "not-yet"
        url = f"sqlite:///{missing_dir / 'powerd.db'}"

        def make_sqlite_reachable() -> None:
            missing_dir.mkdir()
            upgrade(url)

        yield url, make_sqlite_reachable
    else:
        with pg_database(create=False) as url:

            def make_pg_reachable() -> None:
                create_database(url.rsplit("/", 1)[1])
                upgrade(url)

            yield url, make_pg_reachable


def test_writer_buffers_while_the_database_is_unreachable_then_recovers(
    unreachable: tuple[str, Callable[[], None]],
) -> None:
    url, make_reachable = unreachable
    store = Store(url)
    w = writer_for(store, max_queue=10, max_backlog_rows=6)
    try:
        for i in range(25):
            w.submit_event(EventRecord(T0 + i, "e", Severity.INFO, f"event {i}"))
        health = w.health()
        assert (health.backlog, health.dropped) == (10, 15)  # the queue holds the newest 10

        with capture_logs() as logs:
            assert not w.flush()
        health = w.health()
        assert not health.connected
        assert health.last_error
        assert health.last_flush_ts is None
        assert (health.backlog, health.dropped) == (6, 19)  # the row backlog holds 6
        failed = [e for e in logs if e["event"] == "store_flush_failed"]
        assert failed and failed[0]["error"] == health.last_error

        # Submitting goes on as before while writes fail.
        w.submit_event(EventRecord(T0 + 100, "e", Severity.INFO, "event 100"))
        assert w.health().backlog == 7

        make_reachable()
        assert w.flush()
        health = w.health()
        assert health.connected
        assert health.last_error is None
        assert (health.backlog, health.dropped) == (0, 20)
        assert health.last_flush_ts == T0
        assert [e.message for e in store.events().items] == [
            "event 100",
            "event 24",
            "event 23",
            "event 22",
            "event 21",
            "event 20",
        ]
    finally:
        store.close()


def test_writer_reports_a_refused_postgresql_connection() -> None:
    store = Store(f"postgresql://postgres@127.0.0.1:{_closed_port()}/powerd")
    w = writer_for(store, max_queue=3)
    try:
        for i in range(5):
            w.submit_tick(_tick(i))
        assert not w.flush()
        health = w.health()
        assert not health.connected
        assert "OperationalError" in (health.last_error or "")
        assert (health.backlog, health.dropped) == (3, 2)
    finally:
        store.close()


class _StalledStore(Store):
    """A store whose writes hang until released: a database that stopped answering."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.entered = threading.Event()
        self.release = threading.Event()

    def write_batch(self, batch: Batch) -> None:
        self.entered.set()
        self.release.wait()
        super().write_batch(batch)


def test_submits_do_not_wait_for_a_stalled_write(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'powerd.db'}"
    upgrade(url)
    store = _StalledStore(url)
    w = writer_for(store, max_queue=50)
    w.start()
    try:
        w.submit_tick(_tick(0))
        assert store.entered.wait(timeout=30), "the writer thread never tried to write"

        # The writer thread is stuck inside a write; the tick keeps submitting.
        def tick_loop() -> None:
            for i in range(1, 101):
                w.submit_tick(_tick(i))

        submitter = threading.Thread(target=tick_loop)
        submitter.start()
        submitter.join(timeout=30)  # a deadlock guard only: nothing here measures time
        assert not submitter.is_alive(), "submit waited for the stalled writer"
        health = w.health()
        assert health.dropped == 50
        assert health.backlog == 51  # the stalled batch (tick 0) and the queue
    finally:
        store.release.set()
        w.stop()
        store.close()
    # After the stall: the first tick and the 50 newest were written, nothing else.
    ticks = Store(url).recent_ticks(limit=1000)
    assert sorted(t.tick for t in ticks) == [0, *range(51, 101)]


def test_writer_thread_writes_everything_by_stop(store: Store) -> None:
    w = writer_for(store)
    w.start()
    for i in range(3):
        w.submit_tick(_tick(i, ts=T0 + i))
    w.submit_samples(["GPU-a"], T0 + 5, [123.0], [500.0], [0.0])
    w.stop()  # closes the open minute and writes it
    assert [t.tick for t in store.recent_ticks()] == [2, 1, 0]
    [m] = store.gpu_history("GPU-a")
    assert (m.mean_power_w, m.samples) == (123.0, 1)
    assert w.health().backlog == 0


def test_pg_tests_fail_loudly_when_the_server_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from support import pg

    monkeypatch.setattr(pg, "ADMIN_URL", f"postgresql://postgres@127.0.0.1:{_closed_port()}/x")
    with pytest.raises(pytest.fail.Exception, match="PostgreSQL is not reachable"):
        pg.create_database(unique_name())
    assert url_for("db1").endswith("/db1")
