"""Leader leases on real databases (SQLite and PostgreSQL): one leader per scope, epochs that
only grow, lapses decided by the database's clock, and no two winners in a race."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.pg import BACKENDS, pg_database

from powerd.store import upgrade
from powerd.store.db import make_engine
from powerd.store.leases import Leases


@pytest.fixture(params=BACKENDS)
def leases(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Leases]:
    def made(url: str) -> Iterator[Leases]:
        upgrade(url)
        engine = make_engine(url)
        yield Leases(engine)
        engine.dispose()

    if request.param == "sqlite":
        yield from made(f"sqlite:///{tmp_path / 'powerd.db'}")
    else:
        with pg_database() as url:
            yield from made(url)


def test_the_first_leader_renews_and_keeps_its_epoch(leases: Leases) -> None:
    assert leases.current("hall-1") is None
    first = leases.acquire("hall-1", "ctl-a", lease_s=30.0)
    assert first is not None and first.epoch == 1 and not first.lapsed
    assert first.expires_at == pytest.approx(first.db_now + 30.0, abs=1.0)
    renewed = leases.acquire("hall-1", "ctl-a", lease_s=30.0)
    assert renewed is not None and renewed.epoch == 1
    assert renewed.expires_at >= first.expires_at
    assert renewed.acquired_at == first.acquired_at
    # Scopes are independent.
    other = leases.acquire("hall-2", "ctl-b", lease_s=30.0)
    assert other is not None and other.epoch == 1


def test_a_standby_waits_for_the_lease_to_lapse_then_leads_under_a_new_epoch(
    leases: Leases,
) -> None:
    lease_s = 0.5
    assert leases.acquire("hall-1", "ctl-a", lease_s) is not None
    # While the leader's lease runs, nobody else gets it.
    assert leases.acquire("hall-1", "ctl-b", lease_s) is None
    held = leases.current("hall-1")
    assert held is not None and held.holder == "ctl-a" and not held.lapsed
    time.sleep(lease_s + 0.2)  # the leader stopped renewing (killed, paused, cut off)
    lapsed = leases.current("hall-1")
    assert lapsed is not None and lapsed.lapsed
    taken = leases.acquire("hall-1", "ctl-b", lease_s=30.0)
    assert taken is not None and (taken.holder, taken.epoch) == ("ctl-b", 2)
    # The old leader comes back: it cannot renew what it lost.
    assert leases.acquire("hall-1", "ctl-a", lease_s=30.0) is None
    assert leases.release("hall-1", "ctl-a") is False


def test_release_hands_over_at_once_and_epochs_only_grow(leases: Leases) -> None:
    epochs = []
    holders = ["ctl-a", "ctl-b", "ctl-c", "ctl-a", "ctl-b"]
    for holder in holders:
        lease = leases.acquire("row-7", holder, lease_s=60.0)
        assert lease is not None, f"{holder} should take the released lease at once"
        epochs.append(lease.epoch)
        assert leases.release("row-7", holder) is True
    assert epochs == [1, 2, 3, 4, 5]
    # Taking back one's own lapsed lease, with nobody leading in between, keeps the epoch.
    lease = leases.acquire("row-7", "ctl-b", lease_s=60.0)
    assert lease is not None and lease.epoch == 5


@pytest.mark.parametrize("led_before", [False, True], ids=["new-scope", "lapsed-scope"])
def test_of_many_racing_controllers_exactly_one_wins(leases: Leases, led_before: bool) -> None:
    if led_before:
        assert leases.acquire("hall-9", "old", lease_s=60.0) is not None
        assert leases.release("hall-9", "old")
    racers = [f"ctl-{i}" for i in range(8)]
    won: list[str] = []
    start = threading.Barrier(len(racers))

    def race(holder: str) -> None:
        start.wait()
        if leases.acquire("hall-9", holder, lease_s=60.0) is not None:
            won.append(holder)

    threads = [threading.Thread(target=race, args=(r,)) for r in racers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(won) == 1
    lease = leases.current("hall-9")
    assert lease is not None and lease.holder == won[0]
    assert lease.epoch == (2 if led_before else 1)


def test_a_lease_must_have_a_length(leases: Leases) -> None:
    with pytest.raises(ValueError, match="lease_s"):
        leases.acquire("hall-1", "ctl-a", lease_s=0.0)


def test_an_epoch_the_agents_have_seen_lifts_the_next_one(leases: Leases) -> None:
    # A database recreated (or restored from a backup) forgets epochs the agents remember:
    # the next leader's epoch must overtake what they report, or they refuse it.
    first = leases.acquire("hall-1", "ctl-a", lease_s=60.0, above=41)
    assert first is not None and first.epoch == 42
    # Renewing with nothing newer reported keeps the epoch...
    again = leases.acquire("hall-1", "ctl-a", lease_s=60.0)
    assert again is not None and again.epoch == 42
    # ...and a takeover still adds one, or more if the agents say so.
    assert leases.release("hall-1", "ctl-a")
    taken = leases.acquire("hall-1", "ctl-b", lease_s=60.0, above=10)
    assert taken is not None and taken.epoch == 43
    assert leases.release("hall-1", "ctl-b")
    lifted = leases.acquire("hall-1", "ctl-c", lease_s=60.0, above=99)
    assert lifted is not None and lifted.epoch == 100
    with pytest.raises(ValueError, match="above"):
        leases.acquire("hall-1", "ctl-c", lease_s=60.0, above=-1)


def test_members_list_who_runs_for_a_scope(leases: Leases) -> None:
    leases.heartbeat("hall-1", "ctl-b", "standby", 0)
    leases.heartbeat("hall-1", "ctl-a", "leader", 3)
    leases.heartbeat("hall-1", "ctl-c", "standby", 0)
    leases.heartbeat("hall-2", "ctl-x", "leader", 1)
    got = leases.members("hall-1", within_s=30.0)
    assert [(m.holder, m.role, m.epoch) for m in got] == [
        ("ctl-a", "leader", 3),
        ("ctl-b", "standby", 0),
        ("ctl-c", "standby", 0),
    ]
    assert all(0.0 <= m.age_s < 5.0 for m in got)
    # A heartbeat replaces the member's row; a clean stop removes it; old ones drop out.
    leases.heartbeat("hall-1", "ctl-b", "leader", 4)
    leases.heartbeat("hall-1", "ctl-a", "standby", 3)
    leases.forget("hall-1", "ctl-c")
    got = leases.members("hall-1", within_s=30.0)
    assert [(m.holder, m.role) for m in got] == [("ctl-b", "leader"), ("ctl-a", "standby")]
    time.sleep(0.3)
    assert leases.members("hall-1", within_s=0.1) == []
