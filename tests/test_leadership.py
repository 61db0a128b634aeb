"""The leadership rules on a real SQLite store, with the leader's clock in the test's hand:
when a leader stops commanding, when a standby may start, and who may start alone."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.leases import until_lapsed

from powerd.controller.leadership import CLOCK_RHO, Leadership, StartRefused
from powerd.store import upgrade
from powerd.store.db import make_engine
from powerd.store.leases import Leases

LEASE_S = 4.0
RENEW_S = 1.0
MARGIN_S = 0.25


class Hand:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def db(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path / 'powerd.db'}"
    upgrade(url)
    yield url


def leadership(url: str, holder: str, clock: Hand, mode: str = "lease") -> Leadership:
    return Leadership(
        Leases(make_engine(url, timeout_s=0.2)),
        scope="dc",
        holder=holder,
        lease_s=LEASE_S,
        renew_s=RENEW_S,
        mode=mode,  # type: ignore[arg-type]
        clock=clock,
        margin_s=MARGIN_S,
    )


async def test_a_leader_that_cannot_renew_stops_before_its_lease_could_lapse(
    db: str, tmp_path: Path
) -> None:
    clock = Hand()
    a = leadership(db, "ctl-a", clock)
    assert not a.may_command()  # a standby until it holds the lease
    await a.attempt()
    assert a.may_command() and a.epoch == 1 and a.view().role == "leader"
    t0 = clock.t
    # The database locked by someone else: every renewal fails from now on.
    lock = sqlite3.connect(tmp_path / "powerd.db", isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    deadline = t0 + LEASE_S * (1 - CLOCK_RHO) - MARGIN_S
    clock.t = deadline - 0.01
    await a.attempt()
    assert a.failures == 1 and a.last_error
    assert a.may_command(), "still inside the lease it measured before its last renewal"
    clock.t = deadline
    assert not a.may_command(), "stopped before the lease can lapse on the database"
    a.check_deadline()
    assert not a.leading and a.stepped_down == 1 and a.view().leader is None
    lock.execute("ROLLBACK")
    lock.close()


@pytest.mark.slow  # seconds of real time: a lease
async def test_a_standby_leads_only_after_the_lapse_under_a_higher_epoch(db: str) -> None:
    clock = Hand()
    a, b = leadership(db, "ctl-a", clock), leadership(db, "ctl-b", clock)
    await a.attempt()
    await b.attempt()
    assert a.may_command() and not b.may_command()
    assert (b.view().leader, b.view().epoch) == ("ctl-a", 1)
    assert [m.holder for m in b.view().members] == ["ctl-a", "ctl-b"]
    # ctl-a stops renewing (paused, killed); the database's clock runs its lease out.
    await until_lapsed(a.leases)
    await b.attempt()
    assert b.may_command() and b.epoch == 2 and b.takeovers == 1
    # The old leader comes back: it cannot renew, it stands by.
    clock.t += 0.5
    await a.attempt()
    assert not a.may_command() and a.view().leader == "ctl-b"


async def test_an_epoch_the_agents_report_is_overtaken(db: str) -> None:
    clock = Hand()
    a = leadership(db, "ctl-a", clock)
    await a.attempt(above=9)
    assert a.epoch == 10


async def test_a_second_controller_alone_on_the_store_is_refused(db: str) -> None:
    clock = Hand()
    a = leadership(db, "ctl-a", clock, mode="alone")
    await a.claim_alone()
    assert a.may_command() and a.epoch == 1
    b = leadership(db, "ctl-b", clock, mode="alone")
    with pytest.raises(StartRefused, match=r"SQLite.*PostgreSQL"):
        await b.claim_alone(wait_s=0.0)
    # Alone, a controller commands whatever the database says.
    clock.t += 3600
    assert a.may_command()


async def test_a_lone_controller_takes_over_a_dead_predecessors_lapsed_lease(db: str) -> None:
    clock = Hand()
    dead = Leases(make_engine(db))
    assert dead.acquire("dc", "ctl-old", lease_s=0.3) is not None
    b = leadership(db, "ctl-b", clock, mode="alone")
    await until_lapsed(dead)
    await b.claim_alone(wait_s=0.0)
    assert b.epoch == 2


async def test_a_leader_whose_renewals_fail_before_its_deadline_steers_through(
    db: str, tmp_path: Path
) -> None:
    """Found by the chaos soak (bench/chaos.py --db postgresql --pair, seed 1, db_outage of
    7 s): renewals failed at 0.3 s intervals from before the deadline; the tick that came
    after the deadline and before the next failed renewal stepped the leader down
    (`leadership_lost`: "the lease could not be renewed in time"), the fleet fell to
    failsafe and the standby took over when the database returned. The database did fail
    (that is an outage, not a paused host): the leader should steer through it."""
    clock = Hand()
    a = leadership(db, "ctl-a", clock)
    a.through_outage = True
    await a.attempt()
    assert a.may_command()
    lock = sqlite3.connect(tmp_path / "powerd.db", isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        clock.t += RENEW_S  # a renewal that fails, well before the deadline
        await a.attempt()
        assert a.failures == 1 and a.may_command()
        clock.t += LEASE_S  # the deadline passes; the tick comes before the next attempt
        a.check_deadline()
        assert a.may_command(), "stepped down although its database had failed"
    finally:
        lock.execute("ROLLBACK")
        lock.close()


@pytest.mark.slow  # seconds of real time: a lease
async def test_a_leader_steers_through_a_database_outage_until_a_newer_one_is_heard(
    db: str, tmp_path: Path
) -> None:
    """docs/safety.md, "Steering through a database outage": past its deadline a leader
    whose database does not answer keeps commanding; a newer leader of its authority ends
    that at once; a leader whose renewals merely stopped (paused) still stops."""
    clock = Hand()
    a = leadership(db, "ctl-a", clock)
    a.through_outage = True
    await a.attempt()
    assert a.may_command() and a.epoch == 1
    lock = sqlite3.connect(tmp_path / "powerd.db", isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    clock.t += LEASE_S * 3  # far past its deadline, the database still locked
    await a.attempt()
    a.check_deadline()
    assert a.may_command() and a.outage_since is not None and a.leading
    # The database is back: the same holder renews its own lease, the outage is over.
    lock.execute("ROLLBACK")
    await a.attempt()
    assert a.may_command() and a.outage_since is None and a.epoch == 1
    a.supersede(2)  # a stale status, while the database says we lead: the lease decides
    assert a.may_command()
    # Another controller of the authority leads at a higher epoch: stop at once.
    lock.execute("BEGIN EXCLUSIVE")
    clock.t += LEASE_S * 3
    await a.attempt()
    assert a.may_command()
    a.supersede(2)
    assert not a.may_command() and not a.leading and a.stepped_down == 1
    lock.execute("ROLLBACK")
    lock.close()
    # Renewals that stop without a failure (a paused host): the deadline holds.
    b = leadership(db, "ctl-b", clock)
    b.through_outage = True
    await until_lapsed(b.leases)
    await b.attempt()
    assert b.may_command()
    clock.t += LEASE_S
    b.check_deadline()
    assert not b.may_command()


async def test_overlapping_scopes_do_not_lead_together_unless_handed_over(db: str) -> None:
    """The scope registry: a rack's controller does not lead while its row is led (and the
    other way round) on one store, unless the row's leader hands the rack over to it."""
    clock = Hand()

    def member(holder: str, scope: str, overlaps: tuple[str, ...]) -> Leadership:
        lead = Leadership(
            Leases(make_engine(db, timeout_s=0.2)),
            scope=scope,
            holder=holder,
            lease_s=LEASE_S,
            renew_s=RENEW_S,
            clock=clock,
            margin_s=MARGIN_S,
        )
        lead.overlaps = overlaps
        return lead

    row = member("ctl-row", "r1", ("dc", "k1", "k2"))
    rack = member("ctl-rack", "k1", ("dc", "r1"))
    await row.attempt()
    assert row.may_command()
    await rack.attempt()
    assert not rack.may_command() and rack.leases.current("k1") is None
    assert rack.overlap_error is not None and "r1 (led by ctl-row)" in rack.overlap_error
    # The row's leader hands k1 over: the rack's controller may lead beside it.
    row.handing_to = lambda: ("k1",)
    await row.attempt()
    await rack.attempt()
    assert rack.may_command() and rack.overlap_error is None
    # The row, which led first, is not refused by a scope that came after it.
    await row.attempt()
    assert row.may_command() and row.overlap_error is None
    # Without a handover, a second row controller would not take the lease either way.
    whole = member("ctl-all", "dc", ("r1", "k1", "k2"))
    await whole.attempt()
    assert not whole.may_command() and "r1" in (whole.overlap_error or "")


def test_the_domains_that_overlap_a_scope_are_above_and_below_it() -> None:
    from powerd.policy import overlapping_domains, parse_policy

    policy = parse_policy(
        {
            "facility": {
                "name": "dc",
                "budget_w": 7000,
                "rows": [
                    {
                        "name": "r{1..2}",
                        "racks": [
                            {"name": "{row}-k{1..2}", "nodes": [{"name": "{rack}-n1", "gpus": 2}]}
                        ],
                    }
                ],
            },
            "profiles": {"p": {"points": [[200, 0.4], [700, 1.0]]}},
            "classes": {"c": {"weight": 1, "profile": "p"}},
            "defaults": {"class": "c", "failsafe_w": 200},
        }
    )
    assert overlapping_domains(policy, "r1") == ("dc", "r1-k1", "r1-k2")
    assert overlapping_domains(policy, "r2-k1") == ("r2", "dc")
    assert set(overlapping_domains(policy, "dc")) == {
        "r1",
        "r2",
        "r1-k1",
        "r1-k2",
        "r2-k1",
        "r2-k2",
    }
